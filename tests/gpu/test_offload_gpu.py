"""`rollout.offload_train_states` on a GPU: moving FSDP2 shards and AdamW state to CPU frees
their GPU memory, and training after the round trip is bit-identical to training without it.

Needs only CUDA (no vLLM). One process, a world of one, a Qwen2-0.5B-shaped model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.model.loading import apply_fsdp, random_model_config
from spmd_rl.train.offload import move_train_state
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
    for step, ids in enumerate(batches[1:]):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        move_train_state([offloaded], [opt_a], torch.device("cpu"))
        freed = before - torch.cuda.memory_allocated()
        print(f"step {step}: state {state_bytes / 2**30:.3f} GiB, freed {freed / 2**30:.3f} GiB")
        assert freed >= 0.95 * state_bytes, f"offload freed {freed / 2**30:.3f} of {state_bytes / 2**30:.3f} GiB"
        assert all(p.device.type == "cpu" for p in offloaded.parameters())
        move_train_state([offloaded], [opt_a], env.device)
        # the optimizer must still hold the model's own parameters, or updates would go nowhere
        assert {id(p) for g in opt_a.param_groups for p in g["params"]} == {id(p) for p in offloaded.parameters()}
        _train_step(offloaded, opt_a, ids)
        _train_step(reference, opt_b, ids)

    for (name, a), b in zip(offloaded.named_parameters(), reference.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), f"{name} differs after offload round trips"
