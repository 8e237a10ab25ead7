"""A reward model beside the policy on one GPU: the 0.5B preset's work (tests/gpu/test_presets_gpu.py's
model and data, no checkpoints) with a random-weight Qwen2-1.5B-shaped Bradley-Terry reward model
([reward_model]), through vLLM. Every step completes with the engine's log-probs at the actor's,
the reward model's scores are finite and vary. Its share of the step (time/reward_model /
time/step, steps after the first) is printed against the target of 10%, not asserted: a share of
wall-clock time is a benchmark figure (docs/performance.md), never a test's pass condition.

scripts/gpu_check.py runs it as its "reward-model" check (one GPU).
SPMD_RL_GPU_LOG_DIR keeps the run's log and metrics.
"""

from __future__ import annotations

import fcntl
import math

import pytest
import torch
from runs import check_run, keep_logs, model_root, random_model_dir, skip_reason, summary, train
from test_presets_gpu import PRESETS, preset_overrides

pytestmark = pytest.mark.gpu

STEPS = 4
SHARE_TARGET = 0.10
"""The reward model's share of a step that the project aims at, at 1.5B beside a 0.5B policy."""


def random_reward_model_dir(arch: str) -> str:
    """A random-weight one-label sequence classifier of shape `arch` with the character tokenizer,
    bfloat16, built once per machine under runs.model_root() (drawn on the GPU where there is one)."""
    from transformers import AutoModelForSequenceClassification

    from spmd_rl.model.loading import random_model_config
    from spmd_rl.model.tokenizer import build_char_tokenizer

    root = model_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{arch}-char-rm"
    with open(root / f"{arch}-char-rm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            tokenizer = build_char_tokenizer()
            config = random_model_config(arch, tokenizer=tokenizer)
            config.num_labels = 1
            torch.manual_seed(0)
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = AutoModelForSequenceClassification.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return str(out)


def test_a_1p5b_reward_model_beside_a_0p5b_policy(tmp_path):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    name, preset = "reward-model-1.5b", PRESETS["qwen0.5b-gsm8k"]
    overrides = [*preset_overrides("qwen0.5b-gsm8k", random_model_dir("qwen2-0.5b"), -1),
                 f'reward_model.path="{random_reward_model_dir("qwen2-1.5b")}"',
                 "reward_model.max_token_len_per_gpu=65536"]
    run_dir = tmp_path / name
    logs = [train(name, 1, overrides, run_dir, STEPS, "none")]
    steps = check_run(name, run_dir, (STEPS,), logs, max_mismatch=preset.max_mismatch)
    for s, m in steps.items():  # the reward model scored every step's responses
        assert math.isfinite(m["reward/rm_mean"]) and "reward/rule_mean" in m, (s, m)
        assert m.get("time/reward_model", 0) > 0, (s, "no reward model phase in this step")
    assert len({round(steps[s]["reward/rm_mean"], 6) for s in steps}) > 1, "the reward model scored every step alike"
    shares = [steps[s]["time/reward_model"] / steps[s]["time/step"] for s in sorted(steps)[1:]]
    keep_logs(name, logs, run_dir)
    print(summary(name, steps), "reward model share of the step:", [round(x, 4) for x in shares],
          f"(target <= {SHARE_TARGET})")
