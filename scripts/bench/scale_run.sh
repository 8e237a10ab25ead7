#!/usr/bin/env bash
# The scale run of configs/qwen7b.toml (docs/performance.md, "Two and four GPUs"): a random-init
# Qwen2.5-7B-shaped model (no hub on the GPU machines), synthetic arithmetic prompts, GRPO and PPO
# (critic on), each with TP=2 x (GPUs/2) replicas and TP=1 x GPUs replicas; then the per-phase table
# of every run and the 7B TP=2 weight-sync benchmark against its bytes-over-bandwidth floor.
#
#   bash scripts/bench/scale_run.sh [OUT_DIR] [GPUS] [STEPS] [EXTRA OVERRIDES...]
#   e.g. bash scripts/bench/scale_run.sh $OUT 8 5
#        bash scripts/bench/scale_run.sh $OUT 2 5 data.train_batch_size=64   (the same config on 2 GPUs)
#
# SCALE_RUNS picks runs (default "grpo-tp2 ppo-tp2 grpo-tp1 ppo-tp1"); SCALE_BENCH=0 skips the
# benchmark. Logs and metrics of each run are kept under OUT_DIR/<run>/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/scale}; GPUS=${2:-8}; STEPS=${3:-5}; shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$OUT"
COMMON=(model.init=\"random\" model.arch=\"qwen2-7b\" model.tokenizer=\"char\" model.path=\"\"
        data.synthetic_task=\"arithmetic\" data.synthetic_size=8192 data.apply_chat_template=false
        "data.train_files=[]" "data.val_files=[]"
        data.max_prompt_length=128 data.max_response_length=512
        trainer.total_steps=$STEPS trainer.val_every=-1 trainer.save_every=0 trainer.resume=\"none\")
declare -A RUN=(
  [grpo-tp2]='rollout.tensor_parallel_size=2 algorithm.adv_estimator="grpo"'
  [ppo-tp2]='rollout.tensor_parallel_size=2 algorithm.adv_estimator="gae"'
  [grpo-tp1]='rollout.tensor_parallel_size=1 algorithm.adv_estimator="grpo"'
  [ppo-tp1]='rollout.tensor_parallel_size=1 algorithm.adv_estimator="gae"'
)
summary=()
for name in ${SCALE_RUNS:-grpo-tp2 ppo-tp2 grpo-tp1 ppo-tp1}; do
  dir="$OUT/$name"; rm -rf "$dir"; mkdir -p "$dir"
  # shellcheck disable=SC2086
  torchrun --standalone --nproc_per_node="$GPUS" -m spmd_rl.ppo --config configs/qwen7b.toml "${COMMON[@]}" \
      ${RUN[$name]} trainer.run_dir=\"$dir/run\" "$@" > "$dir/log.txt" 2>&1
  echo "$name: exit $? ($(grep -c '"time/step"' "$dir/run/metrics.jsonl" 2>/dev/null || echo 0) steps; log $dir/log.txt)"
  [ -s "$dir/run/metrics.jsonl" ] && summary+=("$name=$dir/run/metrics.jsonl")
done
if [ "${SCALE_BENCH:-1}" = 1 ] && [ "$GPUS" -ge 2 ]; then
  torchrun --standalone --nproc_per_node=2 scripts/bench/bench_rollout.py --arch qwen2-7b --tp 2 --eager \
      --prompts 64 --max-tokens 192 --reps 2 --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
  echo "bench 7b tp2: exit $?"; tail -25 "$OUT/bench.txt"
fi
[ ${#summary[@]} -gt 0 ] && python scripts/summarize_run.py "${summary[@]}"
