#!/usr/bin/env bash
# Sourced by tools/setup_*.sh: installs Debian packages unattended, for the tests
# that need a system component. `apt_install NAME LOG ADVICE PACKAGE...` installs
# the packages with apt-get as root (CI) or with passwordless sudo; elsewhere it
# prints NAME's message with ADVICE (what the tests then do) and returns 0, as it
# also does when apt-get fails (the tests that need the component then skip or
# refuse, saying why). Installing starts no system service: policy-rc.d says no
# while apt-get runs.

apt_install() {
  local name=$1 log=$2 advice=$3
  shift 3
  local packages=("$@")
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$name: no apt-get here: install ${packages[*]} with the system's package manager; $advice" >&2
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      echo "$name: installing ${packages[*]} needs root (or sudo without a password)." \
           "Run: apt-get install ${packages[*]}; $advice" >&2
      return 0
    fi
  fi
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null && "${sudo[@]}" chmod 755 "$policy" \
      && made_policy=1
  fi
  echo "$name: installing ${packages[*]}"
  local code=0
  if ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
      "${packages[@]}" >"$log" 2>&1; then
    "${sudo[@]}" apt-get update -q >>"$log" 2>&1
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
      "${packages[@]}" >>"$log" 2>&1
    code=$?
  fi
  [ "$made_policy" = 1 ] && "${sudo[@]}" rm -f "$policy"
  if [ "$code" != 0 ]; then
    echo "$name: apt-get failed (exit $code; see $log); $advice" >&2
    tail -5 "$log" >&2
  fi
  return 0
}
