#!/usr/bin/env bash
# Checkpoint stalls and restart costs on 2 GPUs, in one go (~8 min for qwen2-7b on 2xH200;
# docs/performance.md, "Checkpoint stall and restart"): scripts/bench/bench_checkpoint.py --phase
# save (sync vs async save stall, step seconds with a save in flight, load), then --phase engine
# twice on one VLLM_CACHE_ROOT (cold, then warm compile cache). Prints each phase's RESULT line and
# wall time.
#
#   bash scripts/bench/bench_checkpoint.sh [OUT_DIR] [ARCH] [CKPT_DIR]
#   e.g. bash scripts/bench/bench_checkpoint.sh $OUT qwen2-7b /tmp/ckbench
#        BENCH_NPROC=1 BENCH_PHASES=save bash scripts/bench/bench_checkpoint.sh $OUT qwen2-1.5b /tmp/ckbench  (one GPU)
#
# BENCH_WRITE_THREADS sets the save phase's writer threads per rank (default: the checkpointer's WRITE_THREADS).
# BENCH_PHASES picks phases (default "engine save"; split them over two calls if one is too short). CKPT_DIR must be on a local disk with room
# for one checkpoint (qwen2-7b: ~85 GiB: fp32 weights + 2 Adam moments).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/bench_checkpoint}; ARCH=${2:-qwen2-7b}; DIR=${3:-/tmp/spmd_rl_bench_checkpoint}
CACHE="$DIR.vllm_cache"
mkdir -p "$OUT"
run() {  # name, args...
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name"
  torchrun --standalone --nproc_per_node="${BENCH_NPROC:-2}" scripts/bench/bench_checkpoint.py --arch "$ARCH" --dir "$DIR" \
      --out "$OUT" "$@" 2>&1 | tee "$OUT/$name.txt" | grep --line-buffered -E '^\[bench r0\]|^RESULT'
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc, $((SECONDS - t0)) s wall (process start included; log $OUT/$name.txt)"
  [ "$rc" = 0 ] || tail -20 "$OUT/$name.txt"
}
for phase in ${BENCH_PHASES:-engine save}; do  # engine first: the save phase prints as it goes
  if [ "$phase" = save ]; then
    run save --phase save ${BENCH_WRITE_THREADS:+--write-threads "$BENCH_WRITE_THREADS"}
  else
    rm -rf "$CACHE"
    run engine_cold --phase engine --tp "${BENCH_NPROC:-2}" --cache "$CACHE"
    run engine_warm --phase engine --tp "${BENCH_NPROC:-2}" --cache "$CACHE"
    rm -rf "$CACHE"
  fi
done
rm -rf "$DIR" "$CACHE"
