"""A mixture-of-experts model trained through the colocated vLLM engine on one GPU: random weights of
Qwen3-30B-A3B's layer shape cut to 4 layers (ARCH_PRESETS "qwen3-30b-a3b-4layers": 128 experts, top-8,
fused experts in the actor, vLLM's fused-MoE kernels in the engine), a few GRPO steps through
`torchrun -m spmd_rl.ppo`, as users start it.

What it proves: the weight sync reaches vLLM's fused-MoE weights (a first sync that left an expert
unset stops the run: VLLMEngine.load_weights' strict check), and at every step the engine's
log-probs of its sampled tokens stay within MAX_MISMATCH of the actor's (an expert tensor synced into
the wrong slot, gate and up swapped, or a transposed down projection shows whole nats), with finite
loss, gradient norm and entropy; tests/gpu/runs.check_run adds what every GPU run must show.

Needs vLLM built with its MoE kernels (`_moe_C`); without them the engine fails to build and this
test FAILS (only a machine without CUDA or vLLM skips). The CPU side of the family (packed = padded,
the HF engine, the FSDP sync) is tests/model/test_model_families.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from runs import check_run, keep_logs, random_model_dir, read_metrics, skip_reason, summary, train
from test_model_families_gpu import FINITE, RUN

pytestmark = pytest.mark.gpu

ARCH = "qwen3-30b-a3b-4layers"
STEPS = 3
MAX_MISMATCH = 0.05
"""Bound of rollout/logprob_diff_mean at every step: above the dense families' 0.02, as routing at bf16 picks
other experts for some tokens in the engine than in the actor (docs/moe.md); a missed or misplaced
expert weight gives tenths of a nat or more."""


def test_moe_trains_through_vllm_with_the_engine_near_the_actors_log_probs(tmp_path):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    name = "moe-qwen3-30b-a3b-4layers"
    model_dir = random_model_dir(ARCH)
    assert json.loads((Path(model_dir) / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    run_dir = tmp_path / name
    logs = [train(name, 1, [f'model.path="{model_dir}"', *RUN], run_dir, STEPS, "none", timeout=500)]
    print(name, "mismatch per step:", [round(m.get("rollout/logprob_diff_mean", float("nan")), 4)
                                       for s, m in sorted(read_metrics(run_dir).items()) if s > 0],
          f"(bound {MAX_MISMATCH})")
    steps = check_run(name, run_dir, (STEPS,), logs, max_mismatch=MAX_MISMATCH)
    for s, m in sorted(steps.items()):
        for key in FINITE:
            assert math.isfinite(m[key]), (name, s, key, m[key])
    keep_logs(name, logs, run_dir)
    print(summary(name, steps))
