"""Moving training state (FSDP2 parameter shards, gradients, optimizer state) between GPU and
CPU, so a rollout engine can have the memory while it generates (`rollout.offload_train_states`).

FSDP2 modules move with `module.to(device)` (their sharded DTensor parameters follow); AdamW's
state tensors are moved one by one. Gradients are already freed after each update
(`update.ppo_update` zeroes them with set_to_none)."""

from __future__ import annotations

import torch


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)


def move_train_state(models: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
                     device: torch.device) -> None:
    """Move models (and their optimizer states) to `device`; then synchronise so the memory is
    really free (or really there) when this returns."""
    for m in models:
        m.to(device)
    for opt in optimizers:
        move_optimizer_state(opt, device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()
