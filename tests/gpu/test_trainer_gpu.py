"""Full training steps on GPUs through the vLLM engine: GRPO and PPO (with critic), on 1 GPU
and on 2 GPUs (TP=2, and TP=1 x 2 replicas), with a random-weight Qwen2-0.5B-shaped model.

Each run is `torchrun -m spmd_rl.ppo` exactly as users start it; the test reads metrics.jsonl.
Checks: every step completes; the engine's log-probs match the FSDP actor's at bf16 level every
step (a broken sync would show nats, not hundredths); the memory sleep hands back is the same at
every step (nothing leaks). SPMD_RL_GPU_LOG_DIR keeps the runs' logs and metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu

STEPS = 4
BASE = [
    'model.init="random"', 'model.arch="qwen2-0.5b"', 'model.tokenizer="char"', 'model.dtype="float32"',
    'model.compute_dtype="bfloat16"', 'data.synthetic_task="successor"', "data.synthetic_size=512",
    "data.train_batch_size=16", "data.max_prompt_length=16", "data.max_response_length=64",
    "rollout.n=4", 'rollout.engine="vllm"', "rollout.gpu_memory_utilization=0.3", "rollout.enforce_eager=true",
    "actor.lr=1e-6", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_gpu=8",
    f"trainer.total_steps={STEPS}", "trainer.val_every=0", 'trainer.device="cuda"', "trainer.save_every=0",
]
RUNS = {
    "grpo-1gpu-tp1": (1, []),
    "ppo-1gpu-tp1-offload": (1, ['algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=8",
                                 "critic.micro_batch_size_per_gpu=8", "rollout.offload_train_states=true"]),
    "grpo-2gpu-tp2": (2, ["rollout.tensor_parallel_size=2"]),
    "ppo-2gpu-tp1x2": (2, ['algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=8",
                           "critic.micro_batch_size_per_gpu=8", "actor.use_kl_loss=true"]),
    # packed rows, token-budget micro-batches, chunked log-probs: actor, reference and critic
    "ppo-1gpu-packed": (1, ['algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=8",
                            "critic.micro_batch_size_per_gpu=8", "actor.use_kl_loss=true",
                            "model.remove_padding=true", "actor.max_token_len_per_gpu=512",
                            "critic.max_token_len_per_gpu=512"]),
}


def _skip_reason(nproc: int) -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (pip install -e .[vllm])"
    if torch.cuda.device_count() < nproc:
        return f"needs {nproc} GPUs, {torch.cuda.device_count()} visible"
    return None


@pytest.mark.parametrize("name", list(RUNS))
def test_training_steps_with_vllm(name, tmp_path):
    nproc, extra = RUNS[name]
    reason = _skip_reason(nproc)
    if reason:
        pytest.skip(reason)
    out_dir = tmp_path / name
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "data"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "spmd_rl.ppo", *BASE, *extra, f"trainer.run_dir={out_dir}",
           f'data.train_files=["{data}/train.parquet"]', "trainer.resume=\"none\""]
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    with open(out_dir / "stdout.log", "w") as log:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=420)
    tail = (out_dir / "stdout.log").read_text()[-4000:]
    assert p.returncode == 0, tail
    steps: dict[int, dict] = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)  # a step's training row, and a row of its checkpoint's stall (the last step)
        steps[rec["step"]] = {**steps.get(rec["step"], {}), **rec}
    assert sorted(steps) == list(range(1, STEPS + 1)), tail
    for s, m in steps.items():
        assert m["rollout/logprob_diff_mean"] < 0.05, (s, m["rollout/logprob_diff_mean"])
        for k, v in m.items():
            assert v == v, (s, k)
    if "offload" in name:
        # actor + critic fp32 parameters and two AdamW moments: 12 bytes per parameter each, on 1 GPU
        # (Qwen2-0.5B shape, 494M parameters); from step 2 on the moments exist and must leave too.
        expected_gb = 2 * 494e6 * 12 / 2**30
        offloaded = [steps[s]["memory/offloaded_gb"] for s in sorted(steps)][1:]
        assert min(offloaded) > 0.8 * expected_gb, f"offload freed {offloaded} GiB, expected ~{expected_gb:.1f}"
    free = [steps[s]["memory/free_after_sleep_gb"] for s in sorted(steps)]
    assert max(free[1:]) - min(free[1:]) < 0.5, f"free memory after sleep drifts: {free}"
    if name == "grpo-1gpu-tp1":
        # After step 1 training only adds AdamW's two fp32 moments (494M parameters): cached
        # allocator blocks must not keep more from the engine.
        adam_gb = 494e6 * 8 / 2**30
        assert free[0] - free[1] < adam_gb + 1.0, f"free after sleep {free}: dropped more than AdamW's {adam_gb:.1f} GiB"
    for s, m in steps.items():  # true memory figures: nothing above the card
        for k, v in m.items():
            if k.startswith("memory/") and k.endswith(("_peak_gb", "_device_gb")):
                assert 0 <= v <= m["memory/device_total_gb"] + 0.01, (s, k, v)
    keep = os.environ.get("SPMD_RL_GPU_LOG_DIR")
    if keep:  # logs and metrics only: the run dir also holds a 2 GB model
        Path(keep).mkdir(parents=True, exist_ok=True)
        for f in ("stdout.log", "metrics.jsonl"):
            (Path(keep) / f"{name}.{f}").write_text((out_dir / f).read_text())
    summary = {k: [round(steps[s][k], 4) for s in sorted(steps)] for k in sorted(steps[STEPS])
               if k.startswith(("time/", "memory/", "rollout/", "perf/"))}
    print(name, json.dumps(summary))
