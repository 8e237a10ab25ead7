"""The PPO-style optimisation loop shared by actor and critic.

`ppo_epochs` passes over the rank's rollouts, cut into mini-batches (one optimizer step each)
and micro-batches (gradient accumulation). Losses are normalised by the *global* mini-batch
count (tokens or sequences over all ranks, see `algorithms.agg_loss`), so the result does not
depend on how many ranks or micro-batches the mini-batch was split into.

The host never waits for the GPU inside a mini-batch: it queues every micro-batch's copy in,
forward and backward and goes on, so the GPU always has work queued while the host prepares the
next. Each wait (reading a GPU value: `.item()`, `float()`, `.cpu()`, `nonzero`, a copy from
pageable memory) drains the GPU's queue and leaves it idle while the host launches the next work.
So micro-batches go in through pinned memory (runtime.transfer.to_device), layouts are counted on
the host's copy of the batch (Batch.host), metrics stay on the device until `MetricSums.read`, and outputs
come back through `batch.HostColumns`. The waits left are once per mini-batch (its loss
denominator, the gradient norm before the optimizer step) and once per update (the metrics).
tests/train/test_update.py checks it on the CPU, tests/gpu/test_update_sync_gpu.py on a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from spmd_rl.batching.batch import Batch, iter_micro_batches
from spmd_rl.model.loading import shares_prompts
from spmd_rl.runtime.distributed import all_reduce_sum
from spmd_rl.train.offload import move_optimizer_state

LossFn = Callable[[Batch, float], tuple[torch.Tensor, dict[str, "torch.Tensor | float"]]]
"""loss_fn(micro_batch, denom) -> (loss, metrics). Metrics whose name ends in "loss" are already
divided by `denom` and add up over micro-batches; all others are token means over the micro-batch
and are weighted here by the micro-batch's share of the mini-batch's tokens. A metric is a float
or a 0-d tensor where it was computed (the GPU: `MetricSums` reads it once per update)."""


class MetricSums:
    """Weighted sums of the micro-batches' metrics, kept where they were computed and read on the
    host once (`read`). Reading a GPU value at every micro-batch would make the host wait there
    until the GPU has run everything queued, the forward included, and leave the GPU idle while the
    host launches the backward and the next micro-batch."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor | float] = {}

    def add(self, key: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        value = value.detach().to(torch.float64) * weight if isinstance(value, torch.Tensor) else float(value) * weight
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def read(self) -> dict[str, float]:
        """Every sum as a float: one copy to the host per device."""
        out: dict[str, float] = {}
        on_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        for k, v in self.sums.items():
            if isinstance(v, torch.Tensor):
                on_device.setdefault(v.device, {})[k] = v.reshape(())
            else:
                out[k] = v
        for sums in on_device.values():
            out.update(zip(sums, torch.stack(list(sums.values())).tolist()))
        return out


def global_denominator(mini: Batch, loss_agg_mode: str, device: torch.device) -> float:
    """The count a micro-batch's summed loss is divided by: global tokens (token-mean) or
    sequences with at least one loss token (seq-mean-*) of the mini-batch, over the ranks, divided
    by the ranks: FSDP averages gradients over all ranks, and so does hybrid sharding (the mean
    over the shard group, then over the replicas; distributed.fsdp_mesh). Tokens and sequences
    masked out of the loss (rollout correction, overlong filtering: zeros in response_mask) leave
    it. With sequence parallelism (trainer.ulysses_size) the ranks of a group hold the same rows,
    so each row is counted once per rank of its group, and every rank's (identical) loss counts
    in the average: the two factors cancel (spmd_rl/batching/sequence_parallel.py, tests/batching/test_sequence_parallel.py)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mask = mini["response_mask"]
    count = mask.sum() if loss_agg_mode == "token-mean" else (mask.sum(-1) > 0).sum()
    return max(float(all_reduce_sum(count.to(device, torch.float64))), 1.0) / world


def ppo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, loss_fn: LossFn, *,
               mini_batch_size: int, micro_batch_size: int, epochs: int, grad_clip: float,
               loss_agg_mode: str, device: torch.device, max_tokens: int = 0,
               offload_optimizer: bool = False) -> dict[str, float]:
    """`max_tokens > 0`: micro-batches by token budget (spmd_rl.batching.batch.plan_micro_batches) instead
    of `micro_batch_size` rows; the loss is normalised by the global mini-batch count either way.
    `offload_optimizer`: the optimizer state lives on CPU and visits `device` for each step."""
    sums = MetricSums()
    n_steps = 0
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            denom = global_denominator(mini, loss_agg_mode, device)
            token_denom = global_denominator(mini, "token-mean", device)
            optimizer.zero_grad(set_to_none=True)
            micros = [mb for _, mb in iter_micro_batches(mini, micro_batch_size, max_tokens, shares_prompts(model))]
            for i, micro in enumerate(micros):
                # Each micro-batch's gradients are reduce-scattered in its backward (FSDP2's default)
                # and accumulate in the shards. Deferring that to the last micro-batch
                # (set_requires_gradient_sync(False)) keeps every parameter's unsharded float32
                # gradient on every rank in between: 4 bytes per parameter of the whole model, on
                # any number of ranks (docs/performance.md, "Memory predicted at start-up").
                # Under HSDP only the all-reduce across replicas waits for the last micro-batch.
                if hasattr(model, "set_requires_all_reduce"):
                    model.set_requires_all_reduce(i == len(micros) - 1)
                loss, metrics = loss_fn(micro.to(device), denom)
                loss.backward()
                share = float(micro["response_mask"].sum()) / token_denom  # the host's copy: no wait
                for k, v in metrics.items():
                    sums.add(k, v, 1.0 if k.endswith("loss") else share)
            grad_norm = clip_grad_norm(model, grad_clip)  # the one wait for the GPU per optimizer step
            if torch.isfinite(torch.tensor(grad_norm)):
                step_optimizer(optimizer, device, offload_optimizer)
            else:
                sums.add("skipped_steps", 1.0)
            sums.add("grad_norm", grad_norm)
            n_steps += 1
    optimizer.zero_grad(set_to_none=True)  # the rollout engine gets the gradients' memory
    out = {k: v / n_steps for k, v in sums.read().items()}
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


def step_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, offload: bool) -> None:
    if offload:
        move_optimizer_state(optimizer, device)
    optimizer.step()
    if offload:
        move_optimizer_state(optimizer, torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies must land before the memory is reused


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
