"""GPU: a trained run's Hugging Face export (trainer.export_hf_dir) served by vLLM gives the same
prompt log-probs as the engine the trainer syncs from the same checkpoint (tests/gpu/export_worker.py).

Random-weight Qwen2-0.5B shape (tied embeddings), 2 GRPO steps with a large learning rate so the
weights move, fp32 masters exported as fp32; both engines run in bf16 from the same fp32 weights,
so they must agree to the last bit (tolerance 1e-3 nats, like the synced-vs-disk check of
test_colocate.py, which measures 0). SPMD_RL_GPU_LOG_DIR keeps the logs.
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
STEPS = 2
TRAIN = [
    'model.init="random"', 'model.arch="qwen2-0.5b"', 'model.tokenizer="char"', 'model.dtype="float32"',
    'model.compute_dtype="bfloat16"', 'data.synthetic_task="successor"', "data.synthetic_size=256",
    "data.train_batch_size=16", "data.max_prompt_length=16", "data.max_response_length=32", "data.val_files=[]",
    "rollout.n=4", 'rollout.engine="vllm"', "rollout.gpu_memory_utilization=0.3", "rollout.enforce_eager=true",
    "actor.lr=1e-3", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_gpu=8",
    # random weights earn reward 0 on this task, so advantages and the policy gradient are 0: the
    # entropy bonus makes the update move the weights, or the export would equal the starting model
    # (on 1xH100 without it: init_vs_synced_mean 0.0, the comparison below could not tell them apart)
    "actor.entropy_coeff=0.01",
    f"trainer.total_steps={STEPS}", 'trainer.device="cuda"', "trainer.tensorboard=false",
]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (pip install -e .[vllm])"
    return None


def _run(cmd, log_path: Path, timeout: int) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    with open(log_path, "w") as log:
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, log_path.read_text()[-4000:]


def test_vllm_serves_the_export_like_the_synced_engine(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = Path(os.environ.get("SPMD_RL_GPU_LOG_DIR", tmp_path)) / "export_gpu"
    out.mkdir(parents=True, exist_ok=True)
    run_dir, export_dir = tmp_path / "run", tmp_path / "hf"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    _run([*torchrun, "-m", "spmd_rl.ppo", *TRAIN, f"trainer.run_dir={run_dir}",
          f'data.train_files=["{run_dir}/data/train.parquet"]', f"trainer.export_hf_dir={export_dir}"],
         out / "train.log", 600)
    assert (export_dir / "model.safetensors").is_file() and (export_dir / "tokenizer.json").is_file()
    grad_norms = [json.loads(line).get("actor/grad_norm") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(g for g in grad_norms), ("the training run did not move the weights", grad_norms)
    _run([*torchrun, str(Path(__file__).with_name("export_worker.py")), "--trained-run", str(run_dir), "--step", str(STEPS),
          "--export", str(export_dir), "--out", str(out)], out / "worker.log", 600)
    res = json.loads((out / "result.json").read_text())
    assert res["ok"], res.get("error")
    assert res["export_vs_synced_max"] <= 1e-3, res
    # the comparison can tell models apart: the starting model is further from the synced one
    assert res["init_vs_synced_mean"] > 10 * max(res["export_vs_synced_mean"], 1e-4), res
