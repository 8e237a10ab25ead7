#!/usr/bin/env bash
# Device proof of rollout correction and DAPO: a 20-step GRPO run of the random Qwen2-0.5B shape on
# one GPU with rollout correction (token TIS + token masking) and DAPO (dynamic sampling, overlong
# filtering and reward shaping), pass@k validation at the end; prints the new metrics of every step.
#
#   bash scripts/probes/dapo_tis_gpu.sh OUT_DIR [STEPS]        (one H100: ~6 min with the engine start)
set -euo pipefail
OUT="${1:?usage: scripts/probes/dapo_tis_gpu.sh OUT_DIR [STEPS]}"
STEPS="${2:-20}"
RUN="${RUN_DIR:-/tmp/dapo-tis}"
rm -rf "$RUN"
mkdir -p "$OUT"
timeout 540 torchrun --nproc_per_node=1 -m spmd_rl.ppo --config configs/qwen0.5b-gsm8k.toml \
  model.init=random model.arch=qwen2-0.5b model.tokenizer=char 'model.path=""' \
  data.synthetic_task=successor data.synthetic_size=1024 \
  "data.train_files=[\"$RUN/data/train.parquet\"]" "data.val_files=[\"$RUN/data/val.parquet\"]" \
  data.max_prompt_length=128 data.max_response_length=256 data.train_batch_size=32 \
  actor.use_kl_loss=false actor.ppo_mini_batch_size=32 rollout.max_num_batched_tokens=4096 \
  algorithm.rollout_is=token algorithm.rollout_mask=token \
  algorithm.dynamic_sampling=true algorithm.dynamic_sampling_max_rounds=4 \
  algorithm.overlong_filtering=true reward.overlong_buffer=64 \
  rollout.val_n=4 rollout.val_temperature=1.0 \
  trainer.total_steps="$STEPS" trainer.val_every=0 trainer.save_every=0 \
  trainer.run_dir="$RUN" trainer.resume=none 2>&1 | tee "$OUT/train.log"
cp "$RUN/metrics.jsonl" "$OUT/"
python - "$RUN/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = sorted({k for r in rows for k in r if k.split("/")[0] in ("rollout_corr", "dynamic_sampling", "val")})
for r in rows:
    print(f"step {r.get('step')}: " + ", ".join(f"{k}={r[k]:.4g}" for k in keys if k in r))
PY
