"""scripts/bench/side_by_side.sh: one-GPU bench_step.sh runs side by side, one per GPU (its DRY=1 lines)."""

from __future__ import annotations

import os
import subprocess

from tests.helpers import ROOT


def test_side_by_side_gives_each_run_its_own_gpu_and_settings(tmp_path):
    """scripts/bench/side_by_side.sh: run i on GPU i, its NAME=VALUE settings reaching bench_step.sh (CONFIG picks
    the preset) and its overrides last, a TOML string's quotes kept."""
    runs = ['TAG=sync CONFIG=configs/qwen7b-lora.toml qwen2-7b after 4 rollout.length_profile="uniform:100"',
            "qwen2-0.5b after 2 rollout.partial_rollouts=true"]
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "bench", "side_by_side.sh"), str(tmp_path), *runs],
                         env=dict(os.environ, DRY="1"), capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 2
    assert out[0].startswith("CUDA_VISIBLE_DEVICES=0 TAG=sync CONFIG=configs/qwen7b-lora.toml torchrun ")
    assert "--config configs/qwen7b-lora.toml" in out[0] and 'model.arch=\\"qwen2-7b\\"' in out[0]
    assert out[0].endswith('rollout.length_profile=\\"uniform:100\\"') and "trainer.total_steps=4" in out[0]
    assert out[1].startswith("CUDA_VISIBLE_DEVICES=1 ") and "--config configs/qwen0.5b-gsm8k.toml" in out[1]
    assert out[1].endswith("rollout.partial_rollouts=true") and "trainer.total_steps=2" in out[1]
