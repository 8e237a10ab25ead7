"""Routing replay through vLLM on one GPU (actor.router_replay; spmd_rl/model/routing.py).

Two GRPO runs of a random qwen3-moe-tiny model (8 experts, top-2; spmd_rl.model.loading.ARCH_PRESETS)
through the colocated vLLM engine, as users start them, identical but for actor.router_replay:
"engine" (vLLM's `enable_return_routed_experts`; every training forward routes each token as the
engine did) and "off" (the trainer's own routing). Each asks the engine for every response's
log-probs, so the trainer-engine mismatch (rollout/logprob_diff_mean) is measured on all tokens.

With replay:
- every token whose routing reaches a log-prob was replayed (routing/replayed_share = 1: vLLM
  returns the prompt's and the generated tokens' routes, prefix-cached ones included);
- the mismatch is below the run without replay's, by at least REPLAY_GAIN (the issue's target: 2x;
  with bf16 the two sides pick different experts for some tokens, which replay removes).
SPMD_RL_GPU_LOG_DIR keeps the runs' logs and metrics.
"""

from __future__ import annotations

import statistics

import pytest
from runs import check_run, keep_logs, random_model_dir, read_metrics, skip_reason, train
from test_model_families_gpu import RUN as FAMILY_RUN

pytestmark = pytest.mark.gpu

ARCH = "qwen3-moe-tiny"
STEPS = 3
MAX_MISMATCH = 0.05
"""Either run's bound at every step (bf16 level; a broken weight sync shows nats)."""
REPLAY_GAIN = 2.0

RUN = [*FAMILY_RUN, "actor.force_old_logprob_pass=true"]
"""The families check's runs (test_model_families_gpu.RUN), with the old log-prob pass: it routes too."""


def test_replay_takes_vllms_routes_and_cuts_the_mismatch(tmp_path):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    model_dir = random_model_dir(ARCH)
    mismatch = {}
    for mode in ("engine", "off"):
        name = f"moe-replay-{mode}"
        run_dir = tmp_path / name
        logs = [train(name, 1, [f'model.path="{model_dir}"', f'actor.router_replay="{mode}"', *RUN], run_dir, STEPS,
                      "none", timeout=500)]
        steps = check_run(name, run_dir, (STEPS,), logs, max_mismatch=MAX_MISMATCH)
        mismatch[mode] = statistics.mean(m["rollout/logprob_diff_mean"] for m in steps.values())
        if mode == "engine":
            shares = [m["routing/replayed_share"] for m in steps.values()]
            assert all(s == 1.0 for s in shares), (name, shares)
        else:
            assert all("routing/replayed_share" not in m for m in read_metrics(run_dir).values()), name
        keep_logs(name, logs, run_dir)
    print("mean mismatch with replay", round(mismatch["engine"], 5), "without", round(mismatch["off"], 5))
    assert mismatch["engine"] * REPLAY_GAIN <= mismatch["off"], mismatch
