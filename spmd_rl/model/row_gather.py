"""Rows of a tensor picked by index, some more than once, with the gradients of a row's copies
summed in float32.

A shared prompt (spmd_rl.batching.shared_prompts) is fed to the model once and read by each of its
responses: its keys and values by every response's attention, its last hidden state by every
response's first log-prob. `x[index]` would do the picking, but its backward adds the copies'
gradients into a tensor of x's dtype, so in bf16 each addition rounds to 8 bits; here they are
added in float32 and rounded once, as if each copy's gradient had flowed on by itself into a
float32 accumulation (a weight gradient's matmul).
"""

from __future__ import annotations

import torch


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.dtype = x.shape[0], x.dtype
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        acc_dtype = torch.promote_types(grad.dtype, torch.float32)
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=acc_dtype)
        out.index_add_(0, index, grad.to(acc_dtype))
        return out.to(ctx.dtype), None


def pick_positions(x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """[1, T, ...] per-position outputs of a one-row input -> [1, N, ...] at `positions` ([N]; a position
    may be picked several times: a shared prompt's last, before each of its responses); x itself when
    None."""
    return x if positions is None else gather_rows(x[0], positions)[None]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 (index: 1-D long); the gradient of a row picked k times is the sum of
    its k copies' gradients, added in float32 (float64 stays float64)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x.index_select(0, index)
    return _GatherRows.apply(x, index)
