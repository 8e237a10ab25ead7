#!/usr/bin/env bash
# One-GPU bench_step.sh runs side by side, one per GPU of this machine, so that the rows of a comparison share
# the machine and the moment (timings move 20-30% between machines). Each argument is one run: bench_step.sh's
# arguments after OUT, led by its NAME=VALUE settings (TAG, CONFIG); words split on spaces, so an override
# holds none (TOML strings keep their quotes). Each run gets GPU i (CUDA_VISIBLE_DEVICES) and its own vLLM
# cache; its output goes to OUT/side-<i>.txt, and the tables are printed once every run has ended.
#
#   bash scripts/bench/side_by_side.sh OUT "RUN 0" "RUN 1" ...
#   e.g. the tail profile at 7B with LoRA, synchronous and with partial rollouts (docs/training.md):
#   P='rollout.length_profile="lognormal:mean=1532,sigma=0.9,cap=8192"'
#   bash scripts/bench/side_by_side.sh $OUT \
#     "TAG=sync CONFIG=configs/qwen7b-lora.toml qwen2-7b after 4 data.max_response_length=8192 $P" \
#     "TAG=partial CONFIG=configs/qwen7b-lora.toml qwen2-7b after 4 data.max_response_length=8192 $P rollout.partial_rollouts=true algorithm.rollout_is=\"token\""
#   DRY=1 prints each run's command line (bench_step.sh's DRY=1) instead of running it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash scripts/bench/side_by_side.sh OUT "RUN 0" "RUN 1" ...}; shift
[ $# -ge 1 ] || { echo "side_by_side.sh: give at least one run" >&2; exit 2; }
mkdir -p "$OUT"
specs=("$@")
pids=()
i=0
for spec in "${specs[@]}"; do
  read -ra words <<< "$spec"
  settings=()
  while [ ${#words[@]} -gt 0 ] && [[ "${words[0]}" =~ ^[A-Z_]+= ]]; do settings+=("${words[0]}"); words=("${words[@]:1}"); done
  run=(env "${settings[@]}" CUDA_VISIBLE_DEVICES=$i VLLM_CACHE_ROOT="$OUT/vllm-cache-$i"
       bash scripts/bench/bench_step.sh "$OUT" "${words[@]}")
  if [ "${DRY:-0}" = 1 ]; then
    echo "CUDA_VISIBLE_DEVICES=$i ${settings[*]} $(DRY=1 "${run[@]}")"
  else
    "${run[@]}" > "$OUT/side-$i.txt" 2>&1 &
    pids+=($!)
  fi
  i=$((i + 1))
done
[ "${DRY:-0}" = 1 ] && exit 0
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for ((j = 0; j < i; j++)); do echo "== GPU $j: ${specs[j]}"; cat "$OUT/side-$j.txt"; done
exit $rc
