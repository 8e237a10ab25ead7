"""AdamW and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def lr_lambda(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr after `step` scheduler steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                   schedule: str = "constant", min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup_steps, total_steps, schedule, min_lr_ratio))
