#!/usr/bin/env bash
# Installs Slurm and munge from the system's packages, for tests/test_slurm.py
# (a real cluster: munge, slurmctld and two slurmd on this host, loopback only;
# the tests start and stop the daemons themselves, nothing is started here).
#
# Unattended: Debian/Ubuntu with apt-get, as root (CI), else a message saying
# why not, and exit 0: the Slurm tests then skip with that reason. Installing
# starts no system service (policy-rc.d says no while apt-get runs).
# Also iproute2 (`ip`, `tc`), for tests/test_bench_network.py (network namespaces).
set -uo pipefail

needed=(munged mungekey slurmctld slurmd srun sbatch scontrol squeue scancel sinfo ip tc)
missing=()
for cmd in "${needed[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" = 0 ]; then
  echo "setup_slurm: Slurm and munge are installed."
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_slurm: missing ${missing[*]} and no apt-get here: install Slurm (slurmctld, slurmd," \
       "its client commands) and munge with the system's package manager; the Slurm tests skip." >&2
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "setup_slurm: missing ${missing[*]}; installing them needs root (or sudo without a" \
         "password). Run: apt-get install slurmctld slurmd slurm-client munge. The Slurm tests skip." >&2
    exit 0
  fi
fi
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null && "${sudo[@]}" chmod 755 "$policy" \
    && made_policy=1
fi
packages=(slurmctld slurmd slurm-client munge iproute2)
echo "setup_slurm: installing ${packages[*]} (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" >/tmp/setup_slurm.log 2>&1; then
  "${sudo[@]}" apt-get update -q >>/tmp/setup_slurm.log 2>&1
  "${sudo[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" >>/tmp/setup_slurm.log 2>&1
fi
code=$?
[ "$made_policy" = 1 ] && "${sudo[@]}" rm -f "$policy"
if [ "$code" != 0 ]; then
  echo "setup_slurm: apt-get failed (exit $code; see /tmp/setup_slurm.log); the Slurm tests skip." >&2
  tail -5 /tmp/setup_slurm.log >&2
fi
exit 0
