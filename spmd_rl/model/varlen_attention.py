"""Attention over packed sequences (no padding), as a transformers attention backend.

A packed micro-batch is one row of concatenated sequences (`spmd_rl.batching.packing`), with position ids
restarting at 0 for each sequence and the sequences' boundaries passed to the model as
`cu_seq_lens_q/k` and `max_length_q/k` (transformers forwards these keyword arguments to every
attention call). This backend, registered as "spmd_varlen", attends within each sequence only:

- on CUDA: PyTorch's own variable-length FlashAttention kernel (`torch.nn.attention.varlen`,
  torch >= 2.10; no flash-attn wheel needed);
- elsewhere (CPU tests): scaled_dot_product_attention sequence by sequence, exact and simple.

Sliding-window layers (Gemma 3: five of every six) pass their window, as transformers' mask does:
a query sees itself and the `sliding_window - 1` tokens before it, within its sequence. The CUDA
kernel takes it as `window_size = (sliding_window - 1, 0)` where this torch's varlen_attn has that
argument (2.13; 2.10/2.11 have only is_causal); where it has not, such a model is refused
(`unsupported`), never run without its window. Attention-logit soft-capping (Gemma 2) and
bidirectional attention are refused too.

A row whose prompts are shared (model.share_prompts, spmd_rl.batching.shared_prompts) also passes
`spmd_kv_index` (KV_INDEX): each sequence's keys are then the packed keys at those indices (a
response's: its prompt's, then its own), delimited by `cu_seq_lens_k`, and its queries are the
packed row's between `cu_seq_lens_q`. A query sees the keys up to its own position counted from the
end (causal, aligned at the bottom right, as FlashAttention does when there are more keys than
queries): a response's first token sees all of its prompt.

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

from spmd_rl.model.row_gather import gather_rows

NAME = "spmd_varlen"
KV_INDEX = "spmd_kv_index"
"""Keyword argument of a packed row with shared prompts: the packed positions of each sequence's keys."""


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1 or (attention_mask is not None and attention_mask.numel()) or dropout \
            or kwargs.get("softcap") is not None or not getattr(module, "is_causal", True):
        # a packed row's mask is empty (packing.empty_mask)
        raise ValueError("packed attention takes one packed row of causal attention, no attention mask, no dropout, "
                         "no soft-capping")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    # max_length_*: packing's Python ints, symbolic under torch.compile (no int() here: it would specialize)
    cu_q, cu_k, max_q, max_k = cu, cu, kwargs["max_length_q"], kwargs["max_length_q"]
    kv_index = kwargs.get(KV_INDEX)
    if kv_index is not None:  # shared prompts: each sequence's keys gathered (a prompt's read by all its responses)
        k, v = gather_rows(k, kv_index), gather_rows(v, kv_index)
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
    if q.is_cuda:
        out = _cuda_varlen(q, k, v, cu_q.to(torch.int32), max_q, scaling, sliding_window, cu_k.to(torch.int32), max_k)
    else:
        out = _sdpa_per_sequence(q, k, v, cu_q, scaling, sliding_window, cu_k)
    return out.unsqueeze(0), None


@torch.compiler.disable  # a Python loop over the sequences: eager under a compiled layer (CPU only)
def _sdpa_per_sequence(q, k, v, cu: torch.Tensor, scale: float | None, window: int | None = None,
                       cu_k: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence i: queries q[cu[i]:cu[i+1]] against keys k[cu_k[i]:cu_k[i+1]] (cu_k: cu when None)."""
    parts = []
    cu_k = (cu if cu_k is None else cu_k).tolist()
    cu = cu.tolist()
    for (s, e), (sk, ek) in zip(zip(cu[:-1], cu[1:]), zip(cu_k[:-1], cu_k[1:])):
        qi = q[s:e].transpose(0, 1)  # [H, n, D]
        ki, vi = (x[sk:ek].transpose(0, 1) for x in (k, v))
        mask = causal_mask(e - s, ek - sk, window, q.device)
        parts.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                    enable_gqa=ki.shape[0] != qi.shape[0]).transpose(0, 1))
    return torch.cat(parts)


def causal_mask(n_q: int, n_k: int, window: int | None, device) -> torch.Tensor | None:
    """[n_q, n_k] bool: query i (at key position i + n_k - n_q: the queries are the last n_q of the
    keys' positions) sees key j when 0 <= i + n_k - n_q - j < window (transformers' sliding_window_overlay
    on the causal mask); None when that is sdpa's is_causal (as many queries as keys, and no window
    or one as long as the sequence)."""
    if n_q == n_k and (window is None or window >= n_k):
        return None
    gap = torch.arange(n_q, device=device)[:, None] + (n_k - n_q) - torch.arange(n_k, device=device)[None, :]
    return (gap >= 0) & (gap < (window if window is not None else n_k + 1))


def _cuda_varlen(q, k, v, cu: torch.Tensor, max_len: int, scale: float | None, window: int | None = None,
                 cu_k: torch.Tensor | None = None, max_len_k: int | None = None) -> torch.Tensor:
    """Sequence i: queries q[cu[i]:cu[i+1]] against keys k[cu_k[i]:cu_k[i+1]] (cu_k: cu when None);
    causality and the window count from the bottom right (the FlashAttention kernel's own alignment)."""
    from torch.nn.attention.varlen import varlen_attn

    causal, gqa = _VARLEN_KW or _varlen_kwargs()  # computed eagerly by register(): nothing for dynamo to trace
    kw = dict(causal)
    if window is not None:
        if "window_size" not in kw:  # refused at start (unsupported); never run a window as full attention
            raise ValueError("this torch's varlen_attn takes no window_size: sliding-window layers cannot be packed")
        kw["window_size"] = (window - 1, 0)
    if q.shape[1] != k.shape[1] and gqa:
        kw["enable_gqa"] = True
    if cu_k is None:
        cu_k, max_len_k = cu, max_len
    return varlen_attn(q, k, v, cu, cu_k, max_len, max_len_k, scale=scale, **kw)


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


def kernel_takes_windows() -> bool:
    """Whether packed attention applies sliding windows here: always on CPU (the per-sequence
    path), on CUDA where torch's varlen_attn has window_size."""
    return not torch.cuda.is_available() or "window_size" in _varlen_params()


def unsupported(config) -> str:
    """Why a model of this transformers config cannot take packed rows here ("" when it can)."""
    config = getattr(config, "get_text_config", lambda: config)()
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped (attn_logit_softcapping), which packed attention does not do"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional (use_bidirectional_attention)"
    if has_sliding_window(config) and not kernel_takes_windows():
        return (f"it has sliding-window layers and torch {torch.__version__}'s varlen_attn takes no window_size "
                "(torch >= 2.13 does)")
    return ""


def has_sliding_window(config) -> bool:
    """Whether any layer attends within a sliding window (Gemma 2/3's "sliding_attention" layers;
    Mistral-style configs with a sliding_window and no layer types)."""
    types = getattr(config, "layer_types", None)
    if types:
        return "sliding_attention" in types and getattr(config, "sliding_window", None) is not None
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


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
