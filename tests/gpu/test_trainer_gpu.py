"""Full training steps on GPUs through the vLLM engine: GRPO and PPO (with critic), on 1 GPU
and on 2 GPUs (TP=2, and TP=1 x 2 replicas), with a random-weight Qwen2-0.5B-shaped model.

Each run is `torchrun -m spmd_rl.ppo` exactly as users start it; the test reads metrics.jsonl.
Checks: every step completes; the engine's log-probs match the FSDP actor's at bf16 level every
step (a broken sync would show nats, not hundredths); the memory sleep hands back is the same at
every step of a process (nothing leaks). SPMD_RL_GPU_LOG_DIR keeps the runs' logs and metrics.

The 1-GPU cases, each one engine start (scripts/gpu_check.sh runs them all in one device call):
- grpo-1gpu-shipped: the shipped configs/qwen0.5b-gsm8k.toml as it is (packed rows, token budgets,
  reference model, CUDA graphs, asynchronous checkpoints) at random weights of its shape on
  synthetic prompts, a checkpoint after every step: 3 steps (saves 1-3 in one process), then a
  resume from step_3 that trains steps 4 and 5 (saves 4-5 in a new process); responses cut to
  128 tokens (random weights never stop early).
- ppo-1gpu-shipped: the same work with a critic on its default micro-batching (the actor's packed
  token budget): its steps against grpo-1gpu-shipped's give the PPO / GRPO step ratio.
- grpo-1gpu-tp1-offload: the padded path, eager engine, train states offloaded while it runs.
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
    "trainer.val_every=0", 'trainer.device="cuda"', "trainer.save_every=0",
]
SHIPPED = [  # configs/qwen0.5b-gsm8k.toml at random weights of its shape, on synthetic prompts
    "--config", str(REPO / "configs" / "qwen0.5b-gsm8k.toml"), 'model.init="random"', 'model.arch="qwen2-0.5b"',
    'model.tokenizer="char"', 'model.path=""', 'data.synthetic_task="arithmetic"', "data.synthetic_size=1024",
    "data.apply_chat_template=false", "data.max_prompt_length=128", "data.max_response_length=128",
    "data.val_batch_size=128", "trainer.val_every=0", "trainer.save_every=1", 'data.val_files=["RUN_DIR/data/val.parquet"]',
]
RUNS = {  # name: (GPUs, overrides, steps per process: a second number resumes the first run)
    "grpo-1gpu-shipped": (1, SHIPPED, (3, 5)),
    # the same work with a critic: its step against grpo-1gpu-shipped's is the PPO / GRPO ratio
    "ppo-1gpu-shipped": (1, [*SHIPPED, 'algorithm.adv_estimator="gae"', "trainer.save_every=0"], (3,)),
    "grpo-1gpu-tp1-offload": (1, [*BASE, "rollout.offload_train_states=true"], (STEPS,)),
    "grpo-2gpu-tp2": (2, [*BASE, "rollout.tensor_parallel_size=2"], (STEPS,)),
    "ppo-2gpu-tp1x2": (2, [*BASE, 'algorithm.adv_estimator="gae"', "critic.ppo_mini_batch_size=8",
                           "critic.micro_batch_size_per_gpu=8", "actor.use_kl_loss=true"], (STEPS,)),
}


def _skip_reason(nproc: int) -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (pip install -e .[vllm])"
    if torch.cuda.device_count() < nproc:
        return f"needs {nproc} GPUs, {torch.cuda.device_count()} visible"
    return None


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Step -> its metrics: a step's training row merged with the row of its checkpoint's stall."""
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps[rec["step"]] = {**steps.get(rec["step"], {}), **rec}
    return steps


def train(name: str, nproc: int, overrides: list[str], run_dir: Path, total: int, resume: str) -> str:
    """One `torchrun -m spmd_rl.ppo` to `total` steps; its log (the run must exit 0)."""
    data = run_dir / "data"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "spmd_rl.ppo", *(o.replace("RUN_DIR", str(run_dir)) for o in overrides), f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={total}", f'data.train_files=["{data}/train.parquet"]', f'trainer.resume="{resume}"']
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    log_path = run_dir / f"stdout-{total}.log"
    with open(log_path, "w") as log:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=420)
    text = log_path.read_text()
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{text[-4000:]}"
    return text


@pytest.mark.parametrize("name", list(RUNS))
def test_training_steps_with_vllm(name, tmp_path):
    nproc, overrides, totals = RUNS[name]
    reason = _skip_reason(nproc)
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = [train(name, nproc, overrides, run_dir, total, "none" if i == 0 else "auto")
            for i, total in enumerate(totals)]
    tail = logs[-1][-4000:]
    steps = {s: m for s, m in read_metrics(run_dir).items() if s > 0}  # step 0: validation before training
    assert sorted(steps) == list(range(1, totals[-1] + 1)), tail
    for s, m in steps.items():
        assert m["rollout/logprob_diff_mean"] < 0.05, (s, m["rollout/logprob_diff_mean"])
        for k, v in m.items():
            assert v == v, (s, k)
    if len(totals) > 1:  # a checkpoint every step, asynchronous: the resume continues from the last one
        first = totals[0]
        assert f"resumed from {run_dir}/checkpoints/step_{first} at step {first}" in logs[1], logs[1][-4000:]
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        assert ckpts == [f"step_{totals[-1] - 1}", f"step_{totals[-1]}"], ckpts  # keep_last = 2
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{totals[-1]}"
        for s in range(1, totals[-1] + 1):
            assert "time/checkpoint" in steps[s], (s, "no checkpoint stall logged")
    if "offload" in name:
        # the actor's fp32 parameters and two AdamW moments: 12 bytes per parameter (Qwen2-0.5B shape,
        # 494M parameters), on 1 GPU; from step 2 on the moments exist and must leave too.
        expected_gb = 494e6 * 12 / 2**30
        offloaded = [steps[s]["memory/offloaded_gb"] for s in sorted(steps)][1:]
        assert min(offloaded) > 0.8 * expected_gb, f"offload freed {offloaded} GiB, expected ~{expected_gb:.1f}"
    free = [steps[s]["memory/free_after_sleep_gb"] for s in sorted(steps)]
    # within each process, after its first step: a resumed process holds the AdamW moments from the start
    bounds = [0, *totals]
    for lo, hi in zip(bounds, bounds[1:]):
        steady = free[lo + 1:hi] if lo == 0 else free[lo:hi]
        if steady:
            assert max(steady) - min(steady) < 0.5, f"free memory after sleep drifts within a process: {free}"
    if name.startswith("grpo-1gpu"):
        # After step 1 training only adds AdamW's two fp32 moments (494M parameters): cached
        # allocator blocks must not keep more from the engine.
        adam_gb = 494e6 * 8 / 2**30
        assert free[0] - free[1] < adam_gb + 1.0, f"free after sleep {free}: dropped more than AdamW's {adam_gb:.1f} GiB"
    for s, m in steps.items():  # true memory figures: nothing above the card
        for k, v in m.items():
            if k.startswith("memory/") and k.endswith(("_peak_gb", "_device_gb")):
                assert 0 <= v <= m["memory/device_total_gb"] + 0.01, (s, k, v)
    keep = os.environ.get("SPMD_RL_GPU_LOG_DIR")
    if keep:  # logs and metrics only: the run dir also holds a 2 GB model and checkpoints
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.stdout.log").write_text("\n".join(logs))
        (Path(keep) / f"{name}.metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    summary = {k: [round(steps[s][k], 4) for s in sorted(steps) if k in steps[s]] for k in sorted(steps[totals[-1]])
               if k.startswith(("time/", "memory/", "rollout/", "perf/"))}
    print(name, json.dumps(summary))
