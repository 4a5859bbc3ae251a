#!/usr/bin/env bash
# Installs Slurm and munge from the system's packages, for tests/test_slurm.py
# (a real cluster: munge, slurmctld and two slurmd on this host, loopback only;
# the tests start and stop the daemons themselves, nothing is started here).
# Also iproute2 (`ip`, `tc`), for tests/test_bench_network.py (network namespaces).
# Unattended, as root (CI) or with passwordless sudo; elsewhere it says why not
# and exits 0: the Slurm tests then skip with that reason.
set -uo pipefail
source "$(dirname "$0")/apt_install.sh"

needed=(munged mungekey slurmctld slurmd srun sbatch scontrol squeue scancel sinfo ip tc)
missing=()
for cmd in "${needed[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if [ "${#missing[@]}" = 0 ]; then
  echo "setup_slurm: Slurm and munge are installed."
  exit 0
fi
echo "setup_slurm: missing ${missing[*]}"
apt_install setup_slurm /tmp/setup_slurm.log "the Slurm tests skip." \
  slurmctld slurmd slurm-client munge iproute2
