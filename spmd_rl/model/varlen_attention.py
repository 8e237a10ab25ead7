"""Attention over packed sequences (no padding), as a transformers attention backend.

A packed micro-batch is one row of concatenated sequences (`spmd_rl.batching.packing`), with position ids
restarting at 0 for each sequence and the sequences' boundaries passed to the model as
`cu_seq_lens_q/k` and `max_length_q/k` (transformers forwards these keyword arguments to every
attention call). This backend, registered as "spmd_varlen", attends within each sequence only:

- on CUDA: PyTorch's own variable-length FlashAttention kernel (`torch.nn.attention.varlen`,
  torch >= 2.10; no flash-attn wheel needed);
- elsewhere (CPU tests): scaled_dot_product_attention sequence by sequence, exact and simple.

Called without boundaries (a padded batch, or generation) it is exactly transformers' "sdpa"
backend, mask included, so one loaded model serves both layouts. With sequence parallelism
(trainer.ulysses_size) spmd_rl.batching.sequence_parallel wraps it: the heads are split across the ranks
by all-to-all, and this runs on whole sequences for each rank's share of them.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

NAME = "spmd_varlen"


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1 or (attention_mask is not None and attention_mask.numel()) or sliding_window is not None \
            or dropout:  # a packed row's mask is empty (packing.empty_mask)
        raise ValueError("packed attention takes one packed row, no attention mask, no sliding window, no dropout")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if q.is_cuda:
        # max_length_q: packing's Python int, symbolic under torch.compile (no int() here: it would specialize)
        out = _cuda_varlen(q, k, v, cu.to(torch.int32), kwargs["max_length_q"], scaling)
    else:
        out = _sdpa_per_sequence(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


@torch.compiler.disable  # a Python loop over the sequences: eager under a compiled layer (CPU only)
def _sdpa_per_sequence(q, k, v, cu: torch.Tensor, scale: float | None) -> torch.Tensor:
    parts = []
    cu = cu.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        parts.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                    enable_gqa=ki.shape[0] != qi.shape[0]).transpose(0, 1))
    return torch.cat(parts)


def _cuda_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    causal, gqa = _VARLEN_KW or _varlen_kwargs()  # computed eagerly by register(): nothing for dynamo to trace
    kw = dict(causal)
    if q.shape[1] != k.shape[1] and gqa:
        kw["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **kw)


_VARLEN_KW: tuple = ()


def _varlen_kwargs() -> tuple:
    """(causal keyword arguments, whether varlen_attn takes enable_gqa) of this torch's varlen_attn."""
    return _causal_kwargs(), "enable_gqa" in _varlen_params()


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def _causal_kwargs() -> tuple:
    # torch 2.10/2.11 take is_causal=True; later versions express causality as window (-1, 0).
    return (("window_size", (-1, 0)),) if "window_size" in _varlen_params() else (("is_causal", True),)


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask without an attention mask: a packed row's boundaries travel as cu_seq_lens (and a
    single unpadded row is plain causal); sdpa's mask for a padded batch. Never a dense [T, T]
    block-diagonal mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function or causal_mask_function, attention_mask, **kwargs)


@functools.cache
def register() -> str:
    """Register the backend with transformers (idempotent); returns its name for from_pretrained."""
    global _VARLEN_KW
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    if torch.cuda.is_available():
        _VARLEN_KW = _varlen_kwargs()
    return NAME
