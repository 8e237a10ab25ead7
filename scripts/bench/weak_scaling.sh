#!/usr/bin/env bash
# Weak scaling of bench_step.sh's 1.5B work, `after` variant (docs/performance.md, "Two and four GPUs"): 64 prompts
# x 8 samples on one GPU, k x 64 prompts on k GPUs, so that every GPU generates and trains the same 512 responses a
# step. The mini-batch grows with the batch (actor.ppo_mini_batch_size = 64 x k): one optimizer step a step on every
# count, on-policy, no old log-prob pass, as on one GPU (with 64 it would take k optimizer steps and that pass).
# Then one table: GPUs, prompts, step s (mean of the steps after the first), generate s (the ranks' mean and the
# slowest rank's, which every rank waits for), update s, and the efficiency t(1)/t(k) against one GPU (target >= 90%).
#
#   bash scripts/bench/weak_scaling.sh OUT [GPU COUNTS] [EXTRA OVERRIDES...]
#   e.g. bash scripts/bench/weak_scaling.sh $OUT                 (1 2 4 8, those above the visible GPUs left out)
#        DRY=1 bash scripts/bench/weak_scaling.sh $OUT "1 2 4 8"  (prints the torchrun commands, runs nothing)
#   STEPS (default 4) steps a run; EXTRA OVERRIDES go to every run, last (they win).
#
# Each count is bench_step.sh's run (GPUS=k, TAG=gpus<k>) in OUT/step-qwen2-1.5b-after-gpus<k>/, without a
# checkpoint at its end. The table takes every count run in OUT so far, so the counts may run in separate calls on
# one machine ("1 2", then "4 8").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$1; COUNTS=${2:-1 2 4 8}; shift $(( $# < 2 ? $# : 2 ))
if [ "${DRY:-0}" != 1 ]; then  # a dry run prints every count asked; a real one leaves out what is not here
  visible=$(python -c 'import sys; sys.path.insert(0, "scripts"); import gpu_check_machine; print(gpu_check_machine.visible_gpus())')
  for k in $COUNTS; do [ "$k" -le "$visible" ] || echo "left out: $k GPUs ($visible visible)"; done
  COUNTS=$(for k in $COUNTS; do [ "$k" -le "$visible" ] && echo "$k"; done)
fi
# The speed settings fixed, not "auto": sharded over more GPUs the state leaves more room, and "auto" would take
# larger token budgets, changing the work per GPU this compares (the 1.5B preset's values on one 80 GB GPU).
FIXED_SPEED="model.gradient_checkpointing=false actor.max_token_len_per_gpu=16384 actor.logprob_max_token_len_per_gpu=32768"
for k in $COUNTS; do
  GPUS=$k TAG=gpus$k bash scripts/bench/bench_step.sh "$OUT" qwen2-1.5b after "${STEPS:-4}" \
      data.train_batch_size=$((64 * k)) actor.ppo_mini_batch_size=$((64 * k)) trainer.save_every=-1 \
      $FIXED_SPEED "$@"
done
[ "${DRY:-0}" = 1 ] && exit 0
runs=()
for m in "$OUT"/step-qwen2-1.5b-after-gpus*/run/metrics.jsonl; do
  [ -s "$m" ] || continue
  k=${m#"$OUT"/step-qwen2-1.5b-after-gpus}; runs+=("${k%%/*}=$m")
done
[ ${#runs[@]} -gt 0 ] && python scripts/summarize_run.py --scaling "${runs[@]}"
