"""Full training steps on GPUs through the vLLM engine: PPO (with critic) and GRPO, on 1 GPU and on
2 GPUs (TP=2, and TP=1 x 2 replicas), with a random-weight Qwen2-0.5B-shaped model.

Each run is `torchrun -m spmd_rl.ppo` exactly as users start it; the test reads metrics.jsonl
(tests/gpu/runs.check_run: every step completes; the engine's log-probs match the FSDP actor's at
bf16 level every step; the memory sleep hands back is the same at every step of a process).
SPMD_RL_GPU_LOG_DIR keeps the runs' logs and metrics. The shipped presets themselves, with a save
and a resume each, are tests/gpu/test_presets_gpu.py.

- ppo-1gpu-shipped: configs/qwen0.5b-gsm8k.toml's work (test_presets_gpu's) with a critic on its
  default micro-batching (the actor's packed token budget): its steps against the 0.5B preset's
  give the PPO / GRPO step ratio (scripts/gpu_check.py prints it).
- grpo-1gpu-tp1-offload: the padded path, eager engine, train states offloaded while it runs.
- lora-1gpu-adapter, lora-1gpu-merged: the 0.5B preset's work with LoRA rank 32 on every linear
  layer, the adapter reaching vLLM each way (model.lora_sync): the engine's LoRA layers with the base
  kept across sleeps (level 1), or merged full weights (level 2); their generate seconds side by side
  are the adapter-versus-merged cost at this shape with CUDA graphs. Random weights give no reward, so
  the adapter does not move here: that it reaches the engine when it does is the LoRA learning check
  (test_learning_gpu.py).
- grpo-2gpu-tp2, ppo-2gpu-tp1x2: the eager 2-GPU layouts (pytest only; scripts/gpu_check.py runs
  the shipped qwen7b preset and the 2-GPU learning check on two GPUs instead).
"""

from __future__ import annotations

import pytest
from runs import check_run, keep_logs, random_model_dir, skip_reason, summary, train
from test_presets_gpu import preset_overrides

pytestmark = pytest.mark.gpu

STEPS = 4
BASE = [
    'model.init="random"', 'model.arch="qwen2-0.5b"', 'model.tokenizer="char"', 'model.dtype="float32"',
    'model.compute_dtype="bfloat16"', 'data.synthetic_task="successor"', "data.synthetic_size=512",
    "data.train_batch_size=16", "data.max_prompt_length=16", "data.max_response_length=64",
    "rollout.n=4", 'rollout.engine="vllm"', "rollout.gpu_memory_utilization=0.3", "rollout.enforce_eager=true",
    "actor.lr=1e-6", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_gpu=8",
    "trainer.val_every=0", 'trainer.device="cuda"', "trainer.save_every=0",
]
LORA = ["model.lora_rank=32", "actor.lr=1e-5"]
RUNS = {  # name: (GPUs, overrides, steps per process)
    "ppo-1gpu-shipped": (1, ["PRESET:qwen0.5b-gsm8k", 'algorithm.adv_estimator="gae"'], (3,)),
    "grpo-1gpu-tp1-offload": (1, [*BASE, "rollout.offload_train_states=true"], (STEPS,)),
    "lora-1gpu-adapter": (1, ["PRESET:qwen0.5b-gsm8k", *LORA], (3,)),
    "lora-1gpu-merged": (1, ["PRESET:qwen0.5b-gsm8k", *LORA, "model.lora_sync=merged"], (3,)),
    "grpo-2gpu-tp2": (2, [*BASE, "rollout.tensor_parallel_size=2"], (STEPS,)),
    "ppo-2gpu-tp1x2": (2, [*BASE, 'algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=8",
                           "critic.micro_batch_size_per_gpu=8", "actor.use_kl_loss=true"], (STEPS,)),
}


def overrides_of(entry: list[str]) -> list[str]:
    """A run's overrides; "PRESET:<name>" stands for that preset's (test_presets_gpu), no checkpoint."""
    if entry and entry[0].startswith("PRESET:"):
        name = entry[0].split(":", 1)[1]
        return [*preset_overrides(name, random_model_dir("qwen2-0.5b"), -1), *entry[1:]]
    return entry


@pytest.mark.parametrize("name", list(RUNS))
def test_training_steps_with_vllm(name, tmp_path):
    nproc, entry, totals = RUNS[name]
    reason = skip_reason(nproc)
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / name
    overrides = overrides_of(entry)
    logs = [train(name, nproc, overrides, run_dir, total, "none" if i == 0 else "auto")
            for i, total in enumerate(totals)]
    steps = check_run(name, run_dir, totals, logs, max_mismatch=0.05)
    if "offload" in name:
        # the actor's fp32 parameters and two AdamW moments: 12 bytes per parameter (Qwen2-0.5B shape,
        # 494M parameters), on 1 GPU; from step 2 on the moments exist and must leave too.
        expected_gb = 494e6 * 12 / 2**30
        offloaded = [steps[s]["memory/offloaded_gb"] for s in sorted(steps)][1:]
        assert min(offloaded) > 0.8 * expected_gb, f"offload freed {offloaded} GiB, expected ~{expected_gb:.1f}"
    if name.startswith("grpo-1gpu"):
        # After step 1 training only adds AdamW's two fp32 moments (494M parameters): cached
        # allocator blocks must not keep more from the engine.
        free = [steps[s]["memory/free_after_sleep_gb"] for s in sorted(steps)]
        adam_gb = 494e6 * 8 / 2**30
        assert free[0] - free[1] < adam_gb + 1.0, f"free after sleep {free}: dropped more than AdamW's {adam_gb:.1f} GiB"
    keep_logs(name, logs, run_dir)
    print(summary(name, steps))
