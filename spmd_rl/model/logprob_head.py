"""Token log-probs and entropy straight from the last hidden states, without a [tokens, vocab]
float32 tensor.

The plain way (`model(...).logits.float()`, `log_softmax`, gather) holds the whole [tokens, vocab]
logits in float32, plus the log-softmax and, under autograd, what backward needs: for a
152k vocabulary that is 0.6 MB per token and copy, 6 GB for a micro-batch of 10k tokens. Here
the LM head runs over chunks of positions; per chunk the float32 logits live only long enough to
give each position its log-sum-exp, the target's log-prob and (optionally) the entropy. Backward
recomputes each chunk's logits from the saved hidden states (one more head matmul per chunk)
instead of keeping them.

The numbers are the plain path's: logits = hidden @ W^T in the head's dtype (bf16 under FSDP
mixed precision), upcast to float32, divided by the temperature, then log-softmax.

`install(model)` gives a causal LM a second way to be called:

    logp, entropy = model(input_ids=..., logprob_targets=targets, temperature=0.7, with_entropy=True)

It goes through `model.__call__`, so FSDP2's root hooks run as for a normal forward: the head's
weight is gathered, and its gradient reduce-scattered in backward, exactly as for `.logits`.
Without `logprob_targets` the call is the model's own forward, unchanged. With `logprob_rows` ([N]
positions of a one-row input; shared prompts, spmd_rl.batching.shared_prompts) the targets [1, N]
are predicted from the hidden states at those positions instead of at every position.

`model.fused_logprob_head = "compile"` runs each chunk's element-wise math (upcast, / T,
log-sum-exp, gather, entropy; in backward the logits' gradient and its cast) as torch.compile'd
functions (`_compiled_stats`, `_compiled_grad_logits`): one or two fused kernels reading the
bf16 logits, instead of a chain of float32 [chunk, vocab] passes. The matmuls stay cuBLAS, the
chunks and the formulas are the same; only the floating-point summation order differs.
"""

from __future__ import annotations

import types

import torch

from spmd_rl.model import fused_kernels
from spmd_rl.model.row_gather import pick_positions

HEAD_MODES = ("none", "compile")

# Positions per chunk are chosen so a chunk's float32 [positions, vocab] temporaries stay near
# this many elements (1 GiB each; the compiled head's bf16 logits and gradient half that),
# whatever the vocabulary: 1766 positions at Qwen2's 152k. Fewer, longer chunks make the head's
# weight-gradient matmul (inner dimension: the chunk's positions) compute-bound and its float32
# accumulation rarer; what smaller chunks cost: docs/performance.md, "Why the defaults are what
# they are".
CHUNK_ELEMENTS = 1 << 28


def chunk_positions(vocab_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(vocab_size, 1))


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for bf16/fp16/fp32; float64 stays float64 (the tests' exact references)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = upcast(h @ W^T) / T, a fresh tensor the caller may overwrite. For small models the
    [chunk, vocab] element-wise passes, not the matmul, dominate the head, so each pass counts."""
    z = _upcast(hidden @ weight.t())
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    """z, and its log-sum-exp and target log-prob, for one chunk."""
    z = _scaled_logits(hidden, weight, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse
    return z, lse, logp


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """lse - sum softmax(z) * z; overwrites z."""
    weighted = (z - lse[:, None]).exp_().mul_(z).sum(-1)
    return lse - weighted


class _ChunkedLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log p(target) [N], entropy [N]) in chunks.

    Gradients, with z = logits / T, p = softmax(z), H = entropy:
      d logp_n / d z_j = 1[j = target] - p_j
      d H_n / d z_j    = -p_j (log p_j + H_n)
    and d z / d logits = 1 / T; the head's gradient is accumulated in float32 over the chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, want_entropy: bool,
                compiled: bool = False):
        n, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.zeros(n if want_entropy else 0, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            if compiled:
                logits = _dynamic_rows(hidden[s:e] @ weight.t())
                out = _compiled_stats()(logits, _dynamic_rows(targets[s:e]), temperature)
                lse[s:e], logp[s:e] = out[0], out[1]
                if want_entropy:
                    entropy[s:e] = out[2]
                del logits, out
                continue
            z, lse[s:e], logp[s:e] = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature)
            if want_entropy:
                entropy[s:e] = _entropy(z, lse[s:e])
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.want_entropy, ctx.compiled = temperature, chunk, want_entropy, compiled
        ctx.mark_non_differentiable(targets)
        ctx.set_materialize_grads(False)  # an unused output (the logged entropy) costs nothing in backward
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        use_entropy = ctx.want_entropy and grad_entropy is not None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h = hidden[s:e]
            if ctx.compiled:
                rows = [_dynamic_rows(x[s:e]) for x in (lse, grad_logp, targets)]
                extra = [_dynamic_rows(x[s:e]) for x in (entropy, grad_entropy)] if use_entropy else [None, None]
                g = _compiled_grad_logits()(_dynamic_rows(h @ weight.t()), *rows, *extra, t, weight.dtype)
                if need_h:
                    grad_h[s:e] = g @ weight
                if need_w:
                    _accumulate(grad_w, g.t(), h)
                del g
                continue
            log_p = _scaled_logits(h, weight, t).sub_(lse[s:e, None])
            if use_entropy:
                p = log_p.exp()
                # -p * g_logp - p * (log p + H) * g_H, computed into log_p's memory
                g = log_p.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None]).add_(grad_logp[s:e, None]).mul_(p).neg_()
                del p
            else:
                g = log_p.exp_().mul_(-grad_logp[s:e, None])
            g.scatter_add_(-1, targets[s:e, None], grad_logp[s:e, None].to(g.dtype))
            if t != 1.0:
                g.div_(t)
            g = g.to(weight.dtype)
            if need_h:
                grad_h[s:e] = g @ weight
            if need_w:
                _accumulate(grad_w, g.t(), h)
            del g
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 and a, b of the head's dtype. On CUDA with bf16/fp16 operands, one
    cuBLAS call that adds the float32 product into acc in place (`addmm` with `out_dtype`): no
    bf16 rounding of the product and no separate pass over acc. Elsewhere, a matmul and an add."""
    if a.dtype != acc.dtype and _fused_accumulate_ok(a, acc):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


_FUSED_ACCUMULATE: dict[tuple, bool] = {}


def _fused_accumulate_ok(a: torch.Tensor, acc: torch.Tensor) -> bool:
    """Whether this torch accumulates a bf16/fp16 product into a float32 tensor in one addmm on
    a's device (CUDA only; torch versions differ in the dtypes of `self` they accept): tried once
    per (device, dtypes) on small matrices against the plain matmul and add."""
    key = (a.device, a.dtype, acc.dtype)
    if key not in _FUSED_ACCUMULATE:
        ok = a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)
        if ok:
            g = torch.Generator(device=a.device).manual_seed(0)
            x, y = (torch.randn(16, 16, device=a.device, generator=g).to(a.dtype) for _ in range(2))
            acc0 = torch.randn(16, 16, device=a.device, dtype=acc.dtype, generator=g)
            want = acc0 + (x.to(acc.dtype) @ y.to(acc.dtype))
            try:
                got = acc0.clone()
                torch.addmm(got, x, y, out_dtype=acc.dtype, out=got)
                ok = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
            except (RuntimeError, TypeError):
                ok = False
        _FUSED_ACCUMULATE[key] = ok
    return _FUSED_ACCUMULATE[key]


# --------------------------------------------------------------------------- compiled chunk math


def _stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(lse, log p(target), entropy) of one chunk's logits: `_chunk_stats` + `_entropy`. The entropy
    is computed whether or not the caller keeps it: passes without it (the reference's, the old
    log-probs') then run the update's graph instead of compiling one of their own, which a restart
    would trace again (docs/performance.md, "Why the defaults are what they are": fewer compiled
    graphs); the extra reduction over a chunk already in cache costs far less than that."""
    z = _upcast(logits)
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None])[:, 0] - lse
    return lse, logp, lse - ((z - lse[:, None]).exp() * z).sum(-1)


def _grad_logits(logits, lse, grad_logp, targets, entropy, grad_entropy, temperature: float, dtype: torch.dtype):
    """d loss / d logits of one chunk, in `dtype`: the eager backward's formula (see
    _ChunkedLogProbs), the target's one-hot term as a comparison with the column index."""
    log_p = _upcast(logits)
    if temperature != 1.0:
        log_p = log_p / temperature
    log_p = log_p - lse[:, None]
    p = log_p.exp()
    if entropy is not None:
        g = -(((log_p + entropy[:, None]) * grad_entropy[:, None] + grad_logp[:, None]) * p)
    else:
        g = -(p * grad_logp[:, None])
    hit = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    g = torch.where(hit, g + grad_logp[:, None].to(g.dtype), g)
    if temperature != 1.0:
        g = g / temperature
    return g.to(dtype)


def _compiled_stats():
    return fused_kernels.compiled(_stats)


def _compiled_grad_logits():
    return fused_kernels.compiled(_grad_logits)


def _dynamic_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    """Mark dim 0 (the chunk's positions: the last chunk is shorter) dynamic for torch.compile, so
    a new remainder does not compile again; the vocabulary stays static."""
    if x is not None:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    return x


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False,
                   chunk: int | None = None, fused: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) under softmax(hidden @ weight^T / temperature), float32, shaped like
    `targets`; and the entropy of the same distributions when `with_entropy` (differentiable only
    with `entropy_grad`: the bonus needs it, the logged metric does not). `fused = "compile"`:
    each chunk's element-wise math torch.compile'd (HEAD_MODES)."""
    if fused not in HEAD_MODES:
        raise ValueError(f"fused log-prob head {fused!r} is not one of {', '.join(HEAD_MODES)}")
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    tg = targets.reshape(-1)
    chunk = chunk or chunk_positions(weight.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    compiled = fused == "compile"
    if not grad:
        logp, ent = _ChunkedLogProbs.forward(_NoCtx(), h, weight, tg, temperature, chunk, with_entropy, compiled)
    else:
        logp, ent = _ChunkedLogProbs.apply(h, weight, tg, temperature, chunk, with_entropy, compiled)
        if with_entropy and not entropy_grad:
            ent = ent.detach()
    return logp.reshape(shape), (ent.reshape(shape) if with_entropy else None)


class _NoCtx:
    """Stands in for autograd's ctx when no graph is built (no saved tensors kept alive)."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def full_logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = False):
    """The plain path: the whole float32 [.., vocab] logits at once (model.chunked_logprobs = false;
    also the reference the chunked path is tested against)."""
    z = _upcast(logits) / temperature
    logp = torch.gather(torch.log_softmax(z, dim=-1), -1, targets[..., None])[..., 0]
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(z if entropy_grad else z.detach())
    return logp, entropy


# Positions per chunk of the no-grad entropy path (entropy_from_logits) are chosen so one chunk's
# float32 temporaries stay near this many elements (256 MiB each), whatever the vocabulary size.
_ENTROPY_CHUNK_ELEMENTS = 1 << 26


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) * z).

    Memory: the logsumexp form needs one vocabulary-sized temporary (the softmax) instead of the
    log-softmax and its product. Without autograd the positions are processed in chunks, each
    upcast on its own, so the float32 temporaries stay a bounded size even for bf16 logits of a
    whole batch. With autograd the softmax must be kept for backward anyway, so it is one pass.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _softmax_entropy(_upcast(logits))
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    rows = max(1, _ENTROPY_CHUNK_ELEMENTS // max(vocab, 1))
    with torch.no_grad():
        parts = [_softmax_entropy(_upcast(chunk)) for chunk in flat.split(rows)]
    return torch.cat(parts).reshape(logits.shape[:-1])


def _softmax_entropy(z: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


# --------------------------------------------------------------------------- model hook


def _logprob_forward(self, *args, logprob_targets: torch.Tensor | None = None, logprob_rows: torch.Tensor | None = None,
                     temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False, **kwargs):
    if logprob_targets is None:
        return type(self).forward(self, *args, **kwargs)
    if self.spmd_chunked_logprobs:
        base = getattr(self, self.base_model_prefix)
        hidden = pick_positions(base(*args, **kwargs).last_hidden_state, logprob_rows)
        out = token_logprobs(hidden, self.get_output_embeddings().weight, logprob_targets, temperature,
                             with_entropy, entropy_grad, fused=getattr(self, "spmd_logprob_head", "none"))
    else:
        logits = pick_positions(type(self).forward(self, *args, **kwargs).logits, logprob_rows)
        out = full_logits_logprobs(logits, logprob_targets, temperature, with_entropy, entropy_grad)
    return tuple(_not_a_view(t) for t in out)


def _not_a_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`, copied where it is a view (a reshape or index of the per-token vector): FSDP2 hooks its
    root's outputs for backward and warns at a view, since an in-place op on one would drop that
    hook. One float per token: nothing next to the forward."""
    return t.clone() if t is not None and t._base is not None else t


def install(model: torch.nn.Module, chunked: bool = True, fused: str = "none") -> torch.nn.Module:
    """Let `model(..., logprob_targets=...)` return (log-probs, entropy) (see the module doc), chunked
    from the hidden states or (chunked=False) from the full logits. The chunked path needs a
    bias-free linear LM head without logit soft-capping. `fused`: HEAD_MODES, for the chunked path
    (`model.spmd_logprob_head` switches it later)."""
    if fused not in HEAD_MODES:
        raise ValueError(f"model.fused_logprob_head = {fused!r} is not one of {', '.join(HEAD_MODES)}")
    head = model.get_output_embeddings()
    config = model.config
    plain_head = isinstance(head, torch.nn.Linear) and head.bias is None
    if chunked and (not plain_head or getattr(config, "final_logit_softcapping", None)):
        raise ValueError(f"{type(model).__name__}: the log-prob head needs a bias-free linear LM head without "
                         "logit soft-capping; set model.chunked_logprobs = false for this model")
    model.forward = types.MethodType(_logprob_forward, model)
    model.spmd_chunked_logprobs = chunked
    model.spmd_logprob_head = fused
    return model
