"""On a GPU, the update's host waits for the GPU as often over 8 micro-batches as over 1: the
shipped packed path (FSDP2, chunked log-prob head, compiled decoder layers and head, the on-policy
log-probs) and the no-grad log-prob pass. torch.cuda's sync debug mode reports every call that
makes the host wait; backward's reports reach the caller as well (checked first, with a backward
that waits on purpose). tests/train/test_update.py checks the same on the CPU with a stand-in device
tensor. Why it matters: each wait drains the GPU's queue, and the GPU idles while the host
launches the next work (docs/performance.md, "Update MFU"; docs/performance-history.md, 2026-11-25)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@contextlib.contextmanager
def counted_syncs():
    """A list that holds, after the block, one entry per synchronizing CUDA call made in it."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message) for w in caught if "synchronizing" in str(w.message))


class _WaitsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()  # makes the host wait, in autograd's thread
        return grad


def test_the_sync_counter_sees_forward_and_backward_waits():
    x = torch.ones(4, device="cuda", requires_grad=True)
    with counted_syncs() as syncs:
        _WaitsInBackward.apply(x).sum().backward()
    assert len(syncs) >= 1, "a .item() in backward was not reported"
    with counted_syncs() as syncs:
        x.sum().item()
    assert len(syncs) >= 1


@pytest.mark.parametrize("fused", ["none", "compile"])
def test_update_waits_as_often_over_8_micro_batches_as_over_1(env, fused):
    from bench_train import rollout_batch

    from spmd_rl.batching.batch import plan_micro_batches
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.config.algorithm import AlgorithmConfig
    from spmd_rl.model.loading import apply_fsdp, prepare_policy, random_model_config
    from spmd_rl.train.actor import actor_loss_fn, compute_logprobs
    from spmd_rl.train.old_logprobs import UpdateLogprobs
    from spmd_rl.train.optim import make_optimizer
    from spmd_rl.train.update import ppo_update

    config = random_model_config("qwen2-0.5b")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = apply_fsdp(prepare_policy(model, remove_padding=True, chunked_logprobs=True, fused_kernels=fused,
                                      fused_logprob_head=fused), env.mesh, torch.bfloat16)
    opt = make_optimizer(model, lr=1e-7, weight_decay=0.0)
    batch = rollout_batch(16, config.vocab_size, 300, seed=0)  # bench_train's ragged RL rows: 116-377 tokens
    lengths = batch["attention_mask"].sum(-1).tolist()
    cfg = ActorConfig(use_kl_loss=False)
    counts = {}
    for budget in (sum(lengths), 600):  # 1 micro-batch; 8 (checked)
        assert len(plan_micro_batches(lengths, 1, budget)) == (1 if budget == sum(lengths) else 8)
        for _ in range(2):  # the first run compiles (fused = "compile"); the second is counted
            own = UpdateLogprobs(batch, AlgorithmConfig())
            with counted_syncs() as syncs:
                ppo_update(model, opt, own.batch, actor_loss_fn(model, cfg, 1.0, own), mini_batch_size=16,
                           micro_batch_size=1, epochs=1, grad_clip=1.0, loss_agg_mode="token-mean",
                           device=env.device, max_tokens=budget)
                own.logprobs(batch["response_mask"])
                compute_logprobs(model, batch, 1.0, 1, env.device, max_tokens=budget)
        counts[budget] = syncs
    print({budget: len(s) for budget, s in counts.items()})
    one, eight = counts.values()
    assert len(eight) == len(one), f"1 micro-batch: {one}\n8 micro-batches: {eight}"
