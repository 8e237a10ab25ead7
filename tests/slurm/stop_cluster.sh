#!/usr/bin/env bash
# Stop the test cluster started by tests/slurm/start_cluster.sh (same $SPMD_RL_SLURM_DIR).
# Cancels its jobs first (job processes outlive slurmd otherwise), then stops slurmd,
# slurmctld and munged -- munged only if start_cluster.sh started it -- by their pids.
# Bounded: gives every process 10 s after SIGTERM, then SIGKILL.
set -uo pipefail

STATE="${SPMD_RL_SLURM_DIR:-/tmp/spmd_rl_slurm}"
export SLURM_CONF="$STATE/slurm.conf"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop_pidfile NAME PIDFILE
  local pid
  alive "$2" || return 0
  pid="$(cat "$2")"
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "stop_cluster.sh: $1 ($pid) ignored SIGTERM for 10 s; killing it" >&2
    kill -9 "$pid" 2>/dev/null
  fi
  echo "stop_cluster.sh: stopped $1 ($pid)"
}

if alive "$STATE/slurmctld.pid" && command -v squeue >/dev/null; then
  jobs="$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
  if [ -n "${jobs// /}" ]; then
    echo "stop_cluster.sh: cancelling jobs $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.3; done
  fi
fi

stop_pidfile slurmd "$STATE/slurmd.pid"
stop_pidfile slurmctld "$STATE/slurmctld.pid"
stop_pidfile munged "$STATE/munged.pid"
rm -f "$STATE/munged.pid"
exit 0
