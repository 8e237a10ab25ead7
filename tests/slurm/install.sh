#!/usr/bin/env bash
# Install what the SLURM tests need: Debian's SLURM 22.05 (slurmctld, slurmd, the
# client commands) and munge. Idempotent: does nothing when they are already there.
# Used by .ci/run before pytest; needs root (or sudo) and an apt mirror.
set -euo pipefail

need=()
for cmd in slurmctld slurmd sbatch munged; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ ${#need[@]} -eq 0 ]; then
  echo "install.sh: slurm and munge are already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install.sh: missing ${need[*]}; run as root or install sudo" >&2; exit 1; }
  SUDO="sudo"
fi

echo "install.sh: installing slurmctld slurmd slurm-client munge (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
# A bounded apt: a dead mirror should fail the CI job in minutes, not hang it.
timeout 600 $SUDO apt-get update -qq
timeout 900 $SUDO apt-get install -y -qq --no-install-recommends \
  slurmctld slurmd slurm-client munge >/dev/null
echo "install.sh: installed $(dpkg-query -W -f '${Package} ${Version}\n' slurmctld munge | tr "\n" " ")"
