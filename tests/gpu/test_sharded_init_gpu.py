"""A resume on a GPU builds the actor on the meta device and lets the checkpoint fill it
(models.build_sharded): the result equals the from_pretrained-built actor that saved the
checkpoint, bitwise, with the rotary inv_freq of from_pretrained (to_empty on CUDA leaves it
garbage) and tied embeddings still one Parameter; bf16 log-probs equal. The broadcast of rank 0's
weights on several GPUs is what tests/gpu/test_colocate.py's actor check (step A) builds.

Needs only CUDA (no vLLM). One process, a world of one (NCCL default group)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer
from spmd_rl.model.loading import ARCH_PRESETS, apply_fsdp, build_sharded, load_causal_lm
from spmd_rl.train.optim import make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    model.reshard()
    return out


def test_resume_builds_on_meta_and_equals_the_saving_actor(env, tmp_path):
    # Qwen2-0.5B's shapes (tied, rope_theta 1e6), two layers
    config = Qwen2Config(**{**ARCH_PRESETS["qwen2-0.5b"], "num_hidden_layers": 2})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "model")
    load = functools.partial(load_causal_lm, str(tmp_path / "model"), torch.float32)
    saved = apply_fsdp(load(), env.mesh, torch.bfloat16)
    opt = make_optimizer(saved, 1e-3, 0.0)
    ids = torch.randint(0, config.vocab_size, (2, 64), device=env.device)
    saved(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ck = Checkpointer(str(tmp_path / "ckpt"), keep_last=1)
    path = ck.save(1, {"actor": ModelAndOptimizer(saved, opt)}, {"step": 1})

    resumed = build_sharded(load, env.mesh, torch.bfloat16, from_checkpoint=True)
    assert ck.load(path, {"actor": ModelAndOptimizer(resumed, make_optimizer(resumed, 1e-3, 0.0))}) == {"step": 1}
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight
    for (n, p), (m, q) in zip(resumed.named_parameters(), saved.named_parameters()):
        assert n == m and p.to_local().device == q.to_local().device and torch.equal(p.to_local(), q.to_local()), n
    buffers = dict(saved.named_buffers())
    assert buffers, "inv_freq is checked"
    for n, b in resumed.named_buffers():
        assert b.device == buffers[n].device and torch.equal(b, buffers[n]), n
    assert torch.equal(_logits(resumed, ids), _logits(saved, ids))
