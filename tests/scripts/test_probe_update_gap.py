"""scripts/probes/probe_update_gap.py --with-engine on CPU, with a stand-in for spmd_rl's VLLMEngine: the
engine gets bench_step's settings and the actor's weights, generates bench_step's rollout (64
prompts x 8 samples x 512 tokens, log-probs of every 8th prompt) and is asleep before the update."""

from __future__ import annotations

import argparse
import os
import sys

from tests.helpers import ROOT
from tests.helpers.dist_utils import run_distributed

sys.path.insert(0, os.path.join(ROOT, "scripts", "probes"))
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))


def _body(rank, world, base):
    import probe_update_gap
    import torch

    from spmd_rl.model.loading import apply_fsdp, load_causal_lm, materialize_random_model, random_model_config
    from spmd_rl.rollout.base import Completion
    from spmd_rl.rollout.vllm import engine as vllm_engine
    from spmd_rl.runtime.distributed import init_distributed

    calls = []

    class StandIn:
        init_seconds = 0.0

        def __init__(self, cfg, model_dir, *ranks):
            calls.append(("build", cfg.rollout.block_size, cfg.engine_sleep_level(), cfg.data.max_response_length, ranks))

        def wake_up(self, tags):
            calls.append(("wake", tuple(tags)))

        def load_weights(self, weights):
            calls.append(("weights", {name: t.dtype for name, t in weights}))

        def generate(self, prompts, sampling):
            calls.append(("generate", len(prompts), sampling.n, sampling.max_new_tokens, sampling.logprobs_every))
            return [[Completion([0] * sampling.max_new_tokens, None, "length")] * sampling.n for _ in prompts]

        def sleep(self):
            calls.append(("sleep",))

    vllm_engine.VLLMEngine = StandIn
    env = init_distributed("cpu")
    model_dir = materialize_random_model(f"{base}/model", random_model_config("tiny"), seed=0, dtype=torch.float32)
    model = apply_fsdp(load_causal_lm(model_dir, torch.float32), env.mesh, torch.float32)
    engine = probe_update_gap.sleeping_engine(argparse.Namespace(arch="qwen2-1.5b", out=base), env, model, model_dir)
    assert engine.stop_ids == []  # EOS ignored: every response runs to 512 tokens, as random weights do
    names = [c[0] for c in calls]
    assert names == ["build", "wake", "weights", "wake", "generate", "sleep"], names
    assert calls[0] == ("build", 64, 2, 512, (0, 1, 0, 1))  # the 1.5B preset's engine, bench_step's lengths
    assert calls[1][1] == ("weights",) and calls[3][1] == ("kv_cache",)
    sent = calls[2][1]
    assert "model.embed_tokens.weight" in sent and len(sent) > 10, sent
    assert set(sent.values()) == {torch.bfloat16}, sent  # what the trainer syncs into the engine
    assert calls[4][1:] == (64, 8, 512, 8)


def test_the_engine_is_built_used_and_asleep_before_the_update(tmp_path):
    run_distributed(_body, 1, str(tmp_path))
