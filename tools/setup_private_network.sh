#!/usr/bin/env bash
# Installs slirp4netns and pasta (package passt) from the system's packages:
# each gives the tasks of a local launch a route out of the network namespace
# kd runs them in (keras_distrib/cluster/network.py, PrivateNetwork), pasta
# where slirp4netns is absent; the tests try both.
# Unattended, as root (CI) or with passwordless sudo; elsewhere it says what to
# install and exits 0 (a launch then takes the privacy the machine allows).
set -uo pipefail
source "$(dirname "$0")/apt_install.sh"

missing=()
command -v slirp4netns >/dev/null 2>&1 || missing+=(slirp4netns)
command -v pasta >/dev/null 2>&1 || missing+=(passt)
if [ ${#missing[@]} = 0 ]; then
  echo "setup_private_network: slirp4netns ($(slirp4netns --version | head -1)) and pasta are installed."
  exit 0
fi
apt_install setup_private_network /tmp/setup_private_network.log \
  "a local launch's tasks then get no route out of their private network where neither is installed." \
  "${missing[@]}"
