"""Asynchronous checkpoints on a GPU: staging goes through pinned host buffers that later saves
reuse, over the checkpointer's gloo group next to the NCCL default group, and the checkpoint holds
the state of the step it was taken at although training changed it during the write.

Needs only CUDA (no vLLM). One process, a world of one (NCCL default group), a small Qwen2 model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer, verify
from spmd_rl.model.loading import apply_fsdp
from spmd_rl.train.optim import make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _actor(env, seed):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = apply_fsdp(AutoModelForCausalLM.from_config(config, dtype=torch.float32), env.mesh, torch.bfloat16)
    return model, make_optimizer(model, 1e-3, 0.0)


def _step(model, opt, env):
    ids = torch.randint(0, 512, (2, 32), device=env.device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt):
    return ([p.to_local().detach().clone() for p in model.parameters()],
            [opt.state[p]["exp_avg_sq"].to_local().clone() for p in model.parameters()])


def test_async_save_on_gpu_pins_reuses_and_holds_the_staged_step(env, tmp_path):
    model, opt = _actor(env, 0)
    _step(model, opt, env)
    ck = Checkpointer(str(tmp_path), keep_last=2, async_save=True)
    models = {"actor": ModelAndOptimizer(model, opt)}
    snap = _snapshot(model, opt)
    ck.save(1, models, {"step": 1})
    for _ in range(3):  # training goes on (NCCL default group) while step 1 is written (gloo group)
        _step(model, opt, env)
    ck.wait()
    staged = ck.saver._stager.stage({k: m.state_dict() for k, m in models.items()})
    weights = [t for t in staged["actor"]["model"].values() if t.numel() > 1000]
    assert weights and all(t.to_local().is_pinned() for t in weights), "staging buffers must be pinned"
    ck.save(2, models, {"step": 2})  # second save: reuses the pinned buffers
    ck.close()
    assert ck.complete_steps() == [1, 2] and verify(str(tmp_path / "step_1"), 1) is None

    fresh, fresh_opt = _actor(env, 1)
    _step(fresh, fresh_opt, env)
    assert ck.load(str(tmp_path / "step_1"), {"actor": ModelAndOptimizer(fresh, fresh_opt)}) == {"step": 1}
    for a, b in zip(_snapshot(fresh, fresh_opt), snap):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
