#!/usr/bin/env bash
# configs/qwen7b.toml as shipped, on 8 GPUs by default (docs/performance.md, "Two and four GPUs" and "Checkpoint
# stall and restart"): FSDP over every rank, vLLM replicas of TP=2, the preset's batch (256 prompts x 8), response
# length, token budgets and engine share. Only the model and the data are not the preset's (no model hub on the GPU
# machines): random weights of the Qwen2.5-7B shape, the character tokenizer, synthetic arithmetic prompts, no
# validation. One process trains 5 steps and saves step 5 (its last: the save waits for its write); a second
# resumes from that checkpoint for 2 more steps and saves nothing. Then the report: summarize_run.py's per-phase
# table (update MFU, peak memory) and its --details (each phase's memory per GPU predicted at start-up against the
# measured, the checkpoint stall, each process's start-up and checkpoint load, the weight sync of every step).
#
#   bash scripts/bench/shipped_7b.sh OUT [GPUS] [EXTRA OVERRIDES...]
#   e.g. bash scripts/bench/shipped_7b.sh $OUT                (8 GPUs)
#        DRY=1 bash scripts/bench/shipped_7b.sh $OUT 4        (prints the two torchrun commands, runs nothing)
#   EXTRA OVERRIDES go to spmd_rl.ppo last (they win); the steps are STEPS and MORE (default 5 and 2).
#
# The run directory, its checkpoint (~91 GB: fp32 weights + AdamW) and random model (~30 GB, fp32) go under
# /dev/shm where it exists (RUN_DIR names another; the train part starts it afresh), as the 7B preset's GPU check
# does: the disk is slow for them and cannot hold keep_last 2 checkpoints. The torchrun output (OUT/train.log,
# OUT/resume.log), and metrics.jsonl, trainer.log and config.toml copied from the run directory, stay in OUT; the
# run directory goes after the resume (KEEP_RUN_DIR=1 keeps it). STAGES picks the parts (default "train resume
# report"), e.g. one device call each where a call's time limit is shorter than the whole (on one machine: the
# run directory must outlive the calls).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$1; GPUS=${2:-8}; shift $(( $# < 2 ? $# : 2 ))
STEPS=${STEPS:-5}; MORE=${MORE:-2}; STAGES=${STAGES:-train resume report}
if [ -z "${RUN_DIR:-}" ]; then
  if [ -d /dev/shm ]; then RUN_DIR=/dev/shm/spmd_rl_shipped_7b; else RUN_DIR=$OUT/run; fi
fi
COMMON=(model.init=\"random\" model.arch=\"qwen2-7b\" model.path=\"\" model.tokenizer=\"char\"
        data.synthetic_task=\"arithmetic\" data.apply_chat_template=false
        "data.train_files=[]" "data.val_files=[]" trainer.val_every=-1
        trainer.run_dir=\"$RUN_DIR\")
TRAIN=(trainer.total_steps=$STEPS trainer.save_every=0 trainer.resume=\"none\")           # 0: a save at the end only
RESUME=(trainer.total_steps=$((STEPS + MORE)) trainer.save_every=-1 trainer.resume=\"auto\")  # -1: no save
compose() { cmd=(torchrun --standalone --nproc_per_node="$GPUS" -m spmd_rl.ppo --config configs/qwen7b.toml
                 "${COMMON[@]}" "$@"); }
show() { local line; line=$(printf '%q ' "${cmd[@]}"); echo "${line% }"; }
keep() { cp "$RUN_DIR"/metrics.jsonl "$RUN_DIR"/trainer.log "$RUN_DIR"/config.toml "$OUT"/ 2>/dev/null; }

if [ "${DRY:-0}" = 1 ]; then
  compose "${TRAIN[@]}" "$@"; show
  compose "${RESUME[@]}" "$@"; show
  exit 0
fi
mkdir -p "$OUT"
for stage in $STAGES; do
  case "$stage" in
    train)
      rm -rf "$RUN_DIR"; rm -f "$OUT"/metrics.jsonl "$OUT"/trainer.log "$OUT"/config.toml
      compose "${TRAIN[@]}" "$@"; "${cmd[@]}" > "$OUT/train.log" 2>&1
      echo "train ($STEPS steps, a save at step $STEPS): exit $? (log $OUT/train.log)"; keep ;;
    resume)  # "auto" would start afresh without the checkpoint (a save skipped for want of space, say)
      [ -d "$RUN_DIR/checkpoints/step_$STEPS" ] || { echo "no checkpoint $RUN_DIR/checkpoints/step_$STEPS"; exit 1; }
      compose "${RESUME[@]}" "$@"; "${cmd[@]}" > "$OUT/resume.log" 2>&1
      echo "resume (to step $((STEPS + MORE))): exit $? (log $OUT/resume.log)"; keep
      [ "${KEEP_RUN_DIR:-0}" = 1 ] || rm -rf "$RUN_DIR" ;;
    report)
      [ -s "$OUT/metrics.jsonl" ] || { echo "no metrics in $OUT"; exit 1; }
      python scripts/summarize_run.py --details "qwen7b-${GPUS}gpu=$OUT/metrics.jsonl"
      echo; grep -h -e "memory: predicted peak per GPU" -e "checkpoints: " -e "training stalled" -e "resumed from" \
          "$OUT/trainer.log" ;;
    *) echo "STAGES: train, resume or report, not $stage"; exit 2 ;;
  esac
done
