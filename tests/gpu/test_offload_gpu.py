"""`rollout.offload_train_states` on a GPU: copying FSDP2 shards and AdamW state into pinned host
buffers frees their GPU memory, every offload after the first reuses the first one's buffers, and
training after the round trips is bit-identical to training without them.

Needs only CUDA (no vLLM). One process, a world of one, a Qwen2-0.5B-shaped model."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.model.loading import apply_fsdp, random_model_config
from spmd_rl.train.offload import TrainStateOffload
from spmd_rl.train.optim import make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                 if isinstance(v, torch.Tensor) and k != "step")
    return params + states


def _train_step(model, opt, ids: torch.Tensor) -> None:
    logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _build(env, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = apply_fsdp(model, env.mesh, torch.bfloat16)
    return model, make_optimizer(model, lr=1e-4, weight_decay=0.01)


def test_offload_frees_state_and_training_is_unchanged(env):
    config = random_model_config("qwen2-0.5b")
    config.num_hidden_layers = 8  # a smaller 0.5B-shaped stack keeps the test quick
    offloaded, opt_a = _build(env, config)
    reference, opt_b = _build(env, config)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (4, 128), generator=gen).to(env.device) for _ in range(3)]

    _train_step(offloaded, opt_a, batches[0])
    _train_step(reference, opt_b, batches[0])
    state_bytes = _local_bytes(offloaded, opt_a)
    offload, buffers = TrainStateOffload(env.device), None
    for step, ids in enumerate(batches[1:]):
        torch.cuda.synchronize()
        before, t0 = torch.cuda.memory_allocated(), time.perf_counter()
        moved = offload.offload([offloaded], [opt_a])
        freed, t1 = before - torch.cuda.memory_allocated(), time.perf_counter()
        assert freed >= 0.95 * state_bytes, f"offload freed {freed / 2**30:.3f} of {state_bytes / 2**30:.3f} GiB"
        assert moved >= state_bytes and offload.host_bytes == moved
        hosts = {k: b.data_ptr() for k, b in offload._host.items()}
        assert all(torch.empty(0, dtype=torch.uint8).set_(b).is_pinned() for b in offload._host.values())
        assert buffers is None or hosts == buffers, "a later offload allocated new host buffers"
        buffers = hosts
        offload.reload()
        print(f"step {step}: state {state_bytes / 2**30:.3f} GiB, moved {moved / 2**30:.3f}, freed {freed / 2**30:.3f} "
              f"GiB; offload {t1 - t0:.3f} s, reload {time.perf_counter() - t1:.3f} s")  # seen, never asserted
        # the optimizer must still hold the model's own parameters, or updates would go nowhere
        assert {id(p) for g in opt_a.param_groups for p in g["params"]} == {id(p) for p in offloaded.parameters()}
        _train_step(offloaded, opt_a, ids)
        _train_step(reference, opt_b, ids)

    for (name, a), b in zip(offloaded.named_parameters(), reference.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), f"{name} differs after offload round trips"
