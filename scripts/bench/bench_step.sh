#!/usr/bin/env bash
# End-to-end GRPO steps on ONE GPU on the peer-comparison work (../shared/device/peer-trl/README.md):
# a random-weight Qwen2 shape, the character tokenizer, synthetic arithmetic prompts, 64 prompts x 8
# samples, 512 new tokens, no reference model, one optimizer step per step. Prints the per-phase table.
#
#   bash scripts/bench/bench_step.sh OUT ARCH VARIANT [STEPS] [EXTRA OVERRIDES...]
#   VARIANT: before = the old training path (padded micro-batches of 8, full fp32 logits, vLLM at
#                     256 sequences, as measured against TRL before packing existed)
#            after  = the shipped config's training settings (packing, token budget, chunked log-probs)
#   e.g. bash scripts/bench/bench_step.sh $OUT qwen2-0.5b after 4
#   EXTRA OVERRIDES go to spmd_rl.ppo last (they win); TAG names the variant's directory and row, so
#   runs that differ only in overrides (vLLM engine arguments, say) are kept side by side:
#   TAG=async bash scripts/bench/bench_step.sh $OUT qwen2-0.5b after 4 'rollout.engine_kwargs={async_scheduling=true}'
#   CONFIG names another preset for the settings (the work stays this script's):
#   TAG=merged CONFIG=configs/qwen7b-lora.toml bash scripts/bench/bench_step.sh $OUT qwen2-7b after 3 model.lora_sync=merged
#   GPUS (default 1) runs the same command on that many GPUs (torchrun --nproc_per_node; the prompts per step
#   are the config's, so scale data.train_batch_size with it for the same work per GPU: weak_scaling.sh);
#   DRY=1 prints the torchrun command line instead of running it. Several runs at once, one per GPU of a
#   machine: side_by_side.sh.
#   A long tail of response lengths (random weights never stop): data.max_response_length=8192
#   'rollout.length_profile="lognormal:mean=1532,sigma=0.9,cap=8192"' (with rollout.partial_rollouts=true: both ways;
#   then scripts/summarize_run.py --per-token sync=OUT/step-.../run/metrics.jsonl partial=... compares them). With a
#   length profile the run's per-token table follows its table: generate seconds, and the share of them after 90%
#   of the samples had finished, each step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$1; ARCH=$2; VARIANT=$3; STEPS=${4:-4}; shift $(( $# < 4 ? $# : 4 ))
case "$ARCH" in qwen2-0.5b) DEFAULT=configs/qwen0.5b-gsm8k.toml ;; *) DEFAULT=configs/qwen1.5b-gsm8k.toml ;; esac
CONFIG=${CONFIG:-$DEFAULT}  # e.g. CONFIG=configs/qwen7b-lora.toml with ARCH qwen2-7b: LoRA at 7B on one GPU
WORK=(model.init=\"random\" model.arch=\"$ARCH\" model.tokenizer=\"char\" model.path=\"\"
      data.synthetic_task=\"arithmetic\" data.apply_chat_template=false data.max_prompt_length=128
      data.max_response_length=512 "data.train_files=[]" "data.val_files=[]"
      actor.use_kl_loss=false actor.ppo_mini_batch_size=64 rollout.max_num_batched_tokens=4096
      trainer.total_steps=$STEPS trainer.val_before_train=false trainer.val_every=-1 trainer.save_every=0
      trainer.resume=\"none\")
case "$VARIANT" in
  before) VAR=(model.remove_padding=false model.chunked_logprobs=false model.gradient_checkpointing=false
               actor.micro_batch_size_per_gpu=8
               actor.max_token_len_per_gpu=0 actor.logprob_max_token_len_per_gpu=0 rollout.max_num_seqs=256) ;;
  after) VAR=() ;;
  *) echo "VARIANT must be before or after"; exit 2 ;;
esac
NAME="$ARCH-$VARIANT${TAG:+-$TAG}"
dir="$OUT/step-$NAME"
cmd=(torchrun --standalone --nproc_per_node="${GPUS:-1}" -m spmd_rl.ppo --config "$CONFIG" "${WORK[@]}" "${VAR[@]}"
     trainer.run_dir=\"$dir/run\" "$@")
if [ "${DRY:-0}" = 1 ]; then line=$(printf '%q ' "${cmd[@]}"); echo "${line% }"; exit 0; fi
rm -rf "$dir"; mkdir -p "$dir"
"${cmd[@]}" > "$dir/log.txt" 2>&1
rc=$?
rm -rf "$dir/run/init_model"  # the random weights, drawn again from the seed (a 7B shape's: 30 GB in OUT)
echo "$ARCH $VARIANT${TAG:+ $TAG}: exit $rc ($(grep -c '"time/step"' "$dir/run/metrics.jsonl" 2>/dev/null || echo 0) steps; log $dir/log.txt)"
[ -s "$dir/run/metrics.jsonl" ] && python scripts/summarize_run.py "$NAME=$dir/run/metrics.jsonl"
case " $* " in *rollout.length_profile=*)
  [ -s "$dir/run/metrics.jsonl" ] && python scripts/summarize_run.py --per-token "$NAME=$dir/run/metrics.jsonl" ;; esac
