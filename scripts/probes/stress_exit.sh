#!/usr/bin/env bash
# Run the tiny CPU job N times back to back under torchrun (2 ranks) and count runs that did not
# end with their documented exit status (a finished run must never abort at shutdown).
#
#   scripts/probes/stress_exit.sh [--mode finish|preempt|config|all] [--keep] N
#
# Modes (each run must end exactly so, every time):
#   finish   trainer.total_steps=1: torchrun exits 0, checkpoints/latest = step_1.
#   preempt  SIGTERM to both ranks once step 1 is logged (as SLURM signals every task): each rank
#            exits 3 (EXIT_PREEMPTED) after writing a checkpoint; torchrun reports it as a failure (1).
#   config   an unknown config key: ranks exit 2 before any process group exists (torchrun's
#            root cause is 2; a rank it SIGTERMs while still starting may end with -15).
#   all      N runs of each mode.
# Every run also checks that no process of the run is left behind. A failed run keeps its directory
# (log + cores, when `ulimit -c` allows) under $STRESS_DIR; PYTHONFAULTHANDLER=1 puts the Python
# stacks of every thread into the log on SIGABRT/SIGSEGV. Summary line at the end:
#   stress_exit: mode=finish runs=N failures=F
# and the exit status is 1 if any run failed.
set -u
MODE=finish
KEEP=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --mode) MODE="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
N="${1:?usage: scripts/probes/stress_exit.sh [--mode finish|preempt|config|all] [--keep] N}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
STRESS_DIR="${STRESS_DIR:-$(mktemp -d /tmp/stress_exit.XXXXXX)}"
mkdir -p "$STRESS_DIR"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONFAULTHANDLER=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
COMMON=("trainer.val_every=0")

# exit statuses of the ranks, as torchrun's failure summary prints them ("exitcode  : 3 (pid: 123)")
rank_codes() { grep -oE 'exitcode *: *-?[0-9]+' "$1" | grep -oE -- '-?[0-9]+$' | sort -u | tr '\n' ' '; }

leftovers() {  # processes whose command line names this run's directory
  local needle="$1" pid
  for pid in $(pgrep -f -- "$needle" 2>/dev/null); do
    [[ "$pid" != "$$" ]] && echo "$pid"
  done
}

one_run() {  # $1 = mode, $2 = index; prints a reason and returns 1 on failure
  local mode="$1" i="$2" dir="$STRESS_DIR/$1_$2" rc codes
  mkdir -p "$dir"
  local cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m spmd_rl.ppo
             --config "$ROOT/configs/tiny-cpu.toml" "trainer.run_dir=$dir/run" "${COMMON[@]}")
  case "$mode" in
    finish)
      (cd "$dir" && exec "${cmd[@]}" trainer.total_steps=1) >"$dir/log" 2>&1; rc=$?
      if [[ $rc -ne 0 ]]; then echo "exit $rc (ranks: $(rank_codes "$dir/log"))"; return 1; fi
      [[ "$(cat "$dir/run/checkpoints/latest" 2>/dev/null)" == step_1 ]] || { echo "no checkpoint step_1"; return 1; } ;;
    preempt)
      (cd "$dir" && exec "${cmd[@]}" trainer.total_steps=50 trainer.save_every=0) >"$dir/log" 2>&1 &
      local agent=$! waited=0
      until grep -q "step 1/50" "$dir/log" 2>/dev/null; do
        sleep 0.2; waited=$((waited + 1))
        if ! kill -0 $agent 2>/dev/null || [[ $waited -gt 1500 ]]; then echo "never reached step 1"; kill -9 $agent 2>/dev/null; return 1; fi
      done
      pkill -TERM -P $agent  # the ranks (children of the torchrun agent), not the agent: like SLURM's signal to every task
      wait $agent; rc=$?
      codes="$(rank_codes "$dir/log")"
      if [[ $rc -ne 1 || "$codes" != "3 " ]]; then echo "torchrun exit $rc, rank codes '$codes' (want 1 and '3 ')"; return 1; fi
      [[ -s "$dir/run/checkpoints/latest" ]] || { echo "no checkpoint written on preemption"; return 1; } ;;
    config)
      (cd "$dir" && exec "${cmd[@]}" trainer.no_such_key=1) >"$dir/log" 2>&1; rc=$?
      # The first rank to fail makes torchrun SIGTERM the others; one still starting up (before
      # any handler exists) then ends with -15. The root cause must be 2, the rest 2 or -15.
      codes="$(rank_codes "$dir/log")"
      local root; root="$(sed -n '/Root Cause/,$p' "$dir/log" | grep -oE 'exitcode *: *-?[0-9]+' | head -1 | grep -oE -- '-?[0-9]+$')"
      if [[ $rc -ne 1 || "$root" != 2 || ! "$codes" =~ ^(-15 )?2\ $ ]]; then
        echo "torchrun exit $rc, root cause '$root', rank codes '$codes' (want 1, 2, '2 ' or '-15 2 ')"; return 1; fi
      grep -q "error: " "$dir/log" || { echo "no 'error:' line"; return 1; } ;;
    *) echo "unknown mode $mode"; return 1 ;;
  esac
  sleep 0.5
  local left; left="$(leftovers "$dir/run")"
  if [[ -n "$left" ]]; then echo "processes left behind: $left"; kill -9 $left 2>/dev/null; return 1; fi
  return 0
}

stress() {  # $1 = mode
  local mode="$1" fails=0 i why t0
  for ((i = 1; i <= N; i++)); do
    t0=$SECONDS
    if why="$(ulimit -c unlimited 2>/dev/null; one_run "$mode" "$i")"; then
      echo "$mode $i/$N ok ($((SECONDS - t0))s)"
      [[ $KEEP -eq 1 ]] || rm -rf "$STRESS_DIR/${mode}_$i"
    else
      fails=$((fails + 1))
      echo "$mode $i/$N FAILED: $why (kept $STRESS_DIR/${mode}_$i)"
    fi
  done
  echo "stress_exit: mode=$mode runs=$N failures=$fails"
  [[ $fails -eq 0 ]]
}

status=0
if [[ "$MODE" == all ]]; then
  for m in finish preempt config; do stress "$m" || status=1; done
else
  stress "$MODE" || status=1
fi
exit $status
