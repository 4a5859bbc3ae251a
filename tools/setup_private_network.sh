#!/usr/bin/env bash
# Installs slirp4netns from the system's packages: kd's local launch runs its
# tasks in a network namespace of their own by default and gives them a route
# out through slirp4netns (keras_distrib/cluster/network.py, PrivateNetwork).
#
# Unattended: Debian/Ubuntu with apt-get, as root (CI) or with passwordless
# sudo; elsewhere it says what to install and exits 0 (a launch then refuses
# to start, naming the package, unless it is told `private_network="offline"`
# or `private_network=False`).
set -uo pipefail

if command -v slirp4netns >/dev/null 2>&1; then
  echo "setup_private_network: slirp4netns is installed ($(slirp4netns --version | head -1))."
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_private_network: slirp4netns is missing and there is no apt-get here: install" \
       "the slirp4netns package with the system's package manager." >&2
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "setup_private_network: slirp4netns is missing; installing it needs root (or sudo" \
         "without a password). Run: apt-get install slirp4netns" >&2
    exit 0
  fi
fi
log=/tmp/setup_private_network.log
echo "setup_private_network: installing slirp4netns"
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends slirp4netns >"$log" 2>&1; then
  "${sudo[@]}" apt-get update -q >>"$log" 2>&1
  "${sudo[@]}" apt-get install -y -q --no-install-recommends slirp4netns >>"$log" 2>&1
fi
code=$?
if [ "$code" != 0 ]; then
  echo "setup_private_network: apt-get failed (exit $code; see $log)." >&2
  tail -5 "$log" >&2
fi
exit 0
