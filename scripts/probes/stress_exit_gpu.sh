#!/usr/bin/env bash
# GPU half of the clean-exit proof (scripts/probes/stress_exit.sh is the CPU half): N back-to-back
# 1-step runs with the vLLM engine (random-weight Qwen2-0.5B shape, char tokenizer, synthetic data;
# nothing to download). Each run must exit 0 and leave no process and no GPU memory behind
# (nvidia-smi: no compute app, used memory back to the level before the runs, within TOL_MIB).
#
#   scripts/probes/stress_exit_gpu.sh [N=10] [NPROC=1] [extra key=value overrides...]
#
# Last line: "stress_exit_gpu: runs=N failures=F"; exit status 1 if any run failed.
set -u
N="${1:-10}"; NPROC="${2:-1}"; shift $(( $# < 2 ? $# : 2 ))
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${STRESS_DIR:-$(mktemp -d /tmp/stress_exit_gpu.XXXXXX)}"
TOL_MIB="${TOL_MIB:-256}"
export PYTHONFAULTHANDLER=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT/data"

used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{s += $1} END {print s}'; }
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' '; }

if [[ -n "$(apps)" ]]; then echo "GPU busy before the runs: $(apps)"; exit 1; fi
base=$(used_mib)
echo "GPU memory used before the runs: ${base} MiB (all GPUs)"
fails=0
for ((i = 1; i <= N; i++)); do
  dir="$OUT/run_$i"; t0=$SECONDS
  torchrun --standalone --nproc_per_node="$NPROC" -m spmd_rl.ppo --config "$ROOT/configs/qwen0.5b-gsm8k.toml" \
    model.init=\"random\" model.arch=\"qwen2-0.5b\" model.tokenizer=\"char\" model.path=\"\" \
    data.synthetic_task=\"arithmetic\" data.synthetic_size=512 data.apply_chat_template=false \
    "data.train_files=[]" "data.val_files=[]" data.train_batch_size=16 \
    data.max_prompt_length=128 data.max_response_length=64 actor.ppo_mini_batch_size=16 \
    trainer.total_steps=1 trainer.val_every=0 trainer.resume=\"none\" trainer.run_dir=\"$dir\" "$@" \
    > "$OUT/run_$i.log" 2>&1
  rc=$?
  sleep 2
  left="$(pgrep -f -- "$dir" | tr '\n' ' ')"; now=$(used_mib); busy="$(apps)"
  why=""
  [[ $rc -ne 0 ]] && why+="exit $rc; "
  [[ -n "$left" ]] && why+="processes left: $left; "
  [[ -n "$busy" ]] && why+="GPU apps left: $busy; "
  (( now > base + TOL_MIB )) && why+="GPU memory ${now} MiB > ${base}+${TOL_MIB}; "
  if [[ -z "$why" ]]; then
    echo "run $i/$N ok ($((SECONDS - t0))s, startup $(grep -o 'start-up: [0-9.]*s since the process started' "$OUT/run_$i.log" | grep -o '[0-9.]*s' | head -1))"
    rm -rf "$dir"  # a 0.5B run leaves ~7 GB (model, checkpoint): ten of them filled a 64 GB disk
  else
    fails=$((fails + 1)); echo "run $i/$N FAILED: $why(log $OUT/run_$i.log)"
    [[ -n "$left" ]] && kill -9 $left 2>/dev/null
  fi
done
echo "stress_exit_gpu: runs=$N failures=$fails"
[[ $fails -eq 0 ]]
