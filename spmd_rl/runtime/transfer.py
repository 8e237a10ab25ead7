"""Host tensors onto the rank's device without making the host wait for the GPU (the rule of a step:
spmd_rl/train/update.py)."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. A CPU tensor goes to a CUDA device through pinned memory and
    non-blocking: the copy is queued behind the GPU's work and the host goes on, where a copy from
    pageable memory waits until the GPU has finished everything queued before it (the pinned block
    is not reused before the copy is done: PyTorch's host allocator records it)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
