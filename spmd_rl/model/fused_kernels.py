"""Fused kernels for the decoder layers of the training-side models (`model.fused_kernels`).

transformers' Qwen2 layer runs RMSNorm, the rotary embedding and SwiGLU as chains of small
element-wise kernels (an RMSNorm alone is ~6 kernels forward, more backward, each a pass over the
activations). Two ways to fuse them, switched per model instance by `apply(model, mode)`:

- "liger": liger-kernel's Triton RMSNorm (casting as transformers' Qwen2RMSNorm: the inverse RMS
  in float32), rotary embedding and SiLU-multiply, through their autograd Functions
  (liger_kernel.ops). Only this instance's modules change (their `forward`), never transformers'
  classes: a model loaded without the switch (the rollout engine's copy) keeps the plain code.
  The rotary embedding is a module-level function of modeling_qwen2, called by the attention; it
  is replaced once by a dispatcher that takes liger's kernel only inside the forward of an
  attention module patched here, on CUDA, and transformers' function everywhere else.
- "compile": torch.compile of each decoder layer's `forward` (regional compilation, as
  torchtitan does): one compiled function per layer class, shared by all its layers (same code;
  the parameters are graph inputs), with dynamic shapes from the first call, since the packed
  length changes every micro-batch (`dynamic=True`; the hidden sizes become static again by
  meeting the parameters' static shapes, the token count, the sequence boundaries and the longest
  sequence stay symbolic, the modules' own ints are constants: `_call_compiled_layer`). Compiled
  graphs are counted by `compiled_graphs()`.

Both keep packed rows working (one row, position ids restarting per sequence, the boundaries as
`cu_seq_lens_*` for spmd_rl.model.varlen_attention) and FSDP2: they replace module `forward`s, and
FSDP2's hooks (in `__call__`) stay outside them, so they may be applied before or after
`fully_shard` (models.prepare_policy applies them before, at load). State-dict names do not change.
A compiled layer does its own activation checkpointing, around the compiled function
(set_layer_checkpointing says why transformers' cannot).

Without CUDA, Triton or liger-kernel (the `gpu` extra), "liger" falls back to the unfused
modules and the process logs one warning (whatever the number of models); a CPU tensor reaching a
patched module also takes the unfused code. "compile" also runs on CPU (inductor's C++ backend;
slow to compile). The numbers are transformers' up to floating-point rounding (bf16 noise), not
bit for bit; tests/gpu/test_fused_gpu.py compares each mode with the unfused path on a GPU.
"""

from __future__ import annotations

import functools
import logging

import torch

from spmd_rl.model.routing import checkpoint_contexts

log = logging.getLogger(__name__)

MODES = ("none", "liger", "compile")

_FALLBACK_WARNED = False
_MISSING = object()
_COMPILED: dict = {}  # (function, torch.compile options) -> its wrapper, one per process (see compiled())
_LIGER_ROPE = [False]  # inside a patched attention forward (a plain global: dynamo can read it)
_ORIGINAL_ROPE: dict = {}  # modeling module -> transformers' apply_rotary_pos_emb


def warn_fallback(message: str) -> None:
    """Log `message` as a warning, once per process (later fallbacks are silent)."""
    global _FALLBACK_WARNED
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED = True
        log.warning(message)


def _reset_warning() -> None:  # tests
    global _FALLBACK_WARNED
    _FALLBACK_WARNED = False


@functools.cache
def _liger_ops():
    """liger-kernel's autograd Functions (their import needs Triton); an ImportError is not cached."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction


def liger_problem(model: torch.nn.Module | None = None, device_type: str | None = None) -> str | None:
    """Why "liger" cannot run here (None: it can): no CUDA, liger-kernel or Triton missing, or a
    model type without a mapping here."""
    device_type = device_type or default_device_type()
    if device_type != "cuda":
        return f"the model runs on {device_type} and liger-kernel's Triton kernels need CUDA"
    try:
        _liger_ops()
    except Exception as e:  # ImportError, or Triton failing to initialise
        return f"liger-kernel cannot be imported ({type(e).__name__}: {e}); install the `gpu` extra"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model is not None and model_type != "qwen2":
        return f"model type {model_type!r} has no liger mapping here (qwen2 only)"
    return None


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply(model: torch.nn.Module, mode: str, device_type: str | None = None) -> str:
    """Switch `model`'s decoder kernels to `mode` ("none", "liger", "compile"), undoing an earlier
    switch first; returns the mode in effect ("none" after a fallback, with one warning per
    process). `device_type`: where the model will run (default: cuda when there is a GPU)."""
    if mode not in MODES:
        raise ValueError(f"fused kernels {mode!r} is not one of {', '.join(MODES)}")
    restore(model)
    patches: list = []
    if mode == "liger":
        problem = liger_problem(model, device_type)
        if problem:
            warn_fallback(f"model.fused_kernels = 'liger': {problem}; the decoder layers run unfused")
            mode = "none"
        else:
            _apply_liger(model, patches)
    elif mode == "compile":
        _apply_compile(model, patches)
    model._spmd_fused_patches = patches
    model.spmd_fused_kernels = mode
    _sync_checkpointing(model)
    return mode


def active_mode(model: torch.nn.Module) -> str:
    return getattr(model, "spmd_fused_kernels", "none")


def restore(model: torch.nn.Module) -> None:
    """Give every module patched by `apply` its forward back."""
    for module, previous in reversed(getattr(model, "_spmd_fused_patches", [])):
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
    model._spmd_fused_patches = []
    model.spmd_fused_kernels = "none"
    _sync_checkpointing(model)


def _set_forward(module: torch.nn.Module, forward, patches: list) -> None:
    patches.append((module, module.__dict__.get("forward", _MISSING)))
    module.__dict__["forward"] = forward


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(model, model.base_model_prefix).layers)


# --------------------------------------------------------------------------- activation checkpointing


def set_layer_checkpointing(layer: torch.nn.Module, on: bool) -> None:
    """Recompute `layer` in backward (activation checkpointing) or keep its activations: the switch
    of one decoder layer (spmd_rl.model.loading.set_gradient_checkpointing sets it on every layer,
    after setting up transformers' checkpointing). Who checkpoints depends on what the layer runs:

    - transformers' forward (fused kernels "none", "liger"): transformers, by the layer's
      `gradient_checkpointing` switch (GradientCheckpointingLayer);
    - the compiled forward ("compile"): `_call_compiled_layer`, with torch's non-reentrant
      checkpoint around the compiled function, so that the backward's recompute runs the compiled
      graphs again; transformers' switch stays off on this layer.

    transformers cannot checkpoint a compiled layer here. Up to 5.17 its GradientCheckpointingLayer
    checkpointed `__call__`, which reached the per-instance compiled forward (forward and recompute
    alike); from 5.24 it wraps each layer class's `forward` instead
    (modeling_layers.GradientCheckpointingLayer.__init_subclass__, forward_with_checkpointing, to
    keep module hooks such as FSDP2's outside the checkpoint), and the per-instance forward skips
    that wrapper. The compiled function (the class's forward) was that wrapper: dynamo met the
    checkpoint inside it, and on CPU, where its body has a graph break (the attention), ran the
    whole checkpoint eagerly: no graph compiled, recompute eager. Under FSDP2 the wrapper found
    the FSDP subclass's own wrapper outermost and did not checkpoint at all (as many activations
    saved as without checkpointing). Checkpointing the compiled function here is what 5.24 does for
    transformers' forward (module hooks outside the checkpoint), on every version."""
    layer.spmd_checkpoint = bool(on)
    layer.gradient_checkpointing = bool(on) and not _is_compiled_layer(layer)


def _sync_checkpointing(model: torch.nn.Module) -> None:
    """After a switch of kernels: hand each checkpointed layer's checkpointing to whoever runs it
    now (set_layer_checkpointing). A model without a `layers` stack (not a decoder here) has none."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    for layer in getattr(base, "layers", ()):
        if hasattr(layer, "spmd_checkpoint"):
            set_layer_checkpointing(layer, layer.spmd_checkpoint)


def _is_compiled_layer(layer: torch.nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _call_compiled_layer


# --------------------------------------------------------------------------- liger


def _apply_liger(model: torch.nn.Module, patches: list) -> None:
    from transformers.models.qwen2 import modeling_qwen2 as mq

    rms_norm, _, silu_mul = _liger_ops()
    _install_rope_dispatch(mq)
    for module in model.modules():
        if isinstance(module, mq.Qwen2RMSNorm):
            _set_forward(module, functools.partial(_liger_rms_norm, module, module.forward, rms_norm), patches)
        elif isinstance(module, mq.Qwen2MLP) and module.config.hidden_act in ("silu", "swish"):
            _set_forward(module, functools.partial(_liger_mlp, module, module.forward, silu_mul), patches)
        elif isinstance(module, mq.Qwen2Attention):
            _set_forward(module, functools.partial(_with_liger_rope, module.forward), patches)


def _on_cuda(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    warn_fallback("model.fused_kernels = 'liger': a patched module got a tensor on "
                  f"{x.device.type}; liger-kernel's Triton kernels need CUDA, running it unfused")
    return False


def _liger_rms_norm(module, unfused, fn, hidden_states):
    """transformers' Qwen2RMSNorm: weight * (x * rsqrt(mean(x^2) + eps) in float32, cast back) --
    liger's "llama" casting; dX is written over dY in backward (nothing else reads that gradient:
    liger's own Qwen2 patch does the same)."""
    if not _on_cuda(hidden_states):
        return unfused(hidden_states)
    return fn.apply(hidden_states, module.weight, module.variance_epsilon, 0.0, "llama", True, None)


def _liger_mlp(module, unfused, fn, x):
    """down(silu(gate(x)) * up(x)) with the SiLU-multiply fused (forward and backward)."""
    if not _on_cuda(x):
        return unfused(x)
    return module.down_proj(fn.apply(module.gate_proj(x), module.up_proj(x), 1.0, 1.0))


def _with_liger_rope(unfused, *args, **kwargs):
    _LIGER_ROPE[0] = True
    try:
        return unfused(*args, **kwargs)
    finally:
        _LIGER_ROPE[0] = False


def _install_rope_dispatch(modeling) -> None:
    """Replace `modeling.apply_rotary_pos_emb` (once) by a dispatcher that is transformers' own
    function except inside a patched attention's forward on CUDA."""
    if modeling in _ORIGINAL_ROPE:
        return
    original = modeling.apply_rotary_pos_emb
    _, rope, _ = _liger_ops()

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _LIGER_ROPE[0] and q.is_cuda:
            # q/k [b, heads, T, head_dim] (views of the projections' output), cos/sin [b or 1, T, head_dim]
            return rope.apply(q, k, cos, sin, None, unsqueeze_dim, None)
        return original(q, k, cos, sin, unsqueeze_dim)

    _ORIGINAL_ROPE[modeling] = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


# --------------------------------------------------------------------------- torch.compile


def raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo keeps `recompile_limit` (8) graphs per code object and runs the code eagerly past it.
    One decoder-layer class serves actor, reference and critic, with and without gradients (each
    its own graph), so allow more; bench_train counts the graphs actually made."""
    cfg = torch._dynamo.config
    if getattr(cfg, "recompile_limit", limit) < limit:
        cfg.recompile_limit = limit


COMPILE_OPTIONS: dict = {}
"""Extra torch.compile arguments for every compiled function (the CPU tests use
{"backend": "aot_eager"}: dynamo and AOTAutograd without inductor's minute of C++ codegen)."""


def compiled(fn, **kwargs):
    """One torch.compile wrapper per function per process (a new wrapper would compile anew)."""
    kwargs = {**kwargs, **COMPILE_OPTIONS}
    key = (fn, tuple(sorted(kwargs.items())))
    if key not in _COMPILED:
        raise_recompile_limit()
        _COMPILED[key] = torch.compile(fn, **kwargs)
    return _COMPILED[key]


def _apply_compile(model: torch.nn.Module, patches: list) -> None:
    for layer in decoder_layers(model):
        forward = compiled(type(layer).forward, dynamic=True)
        _set_forward(layer, functools.partial(_call_compiled_layer, forward, layer), patches)


def _call_compiled_layer(forward, layer, *args, **kwargs):
    """The compiled layer, traced without duck sizing: every input size gets a symbol of its own, so
    a packed row's sequence count that happens to equal the head size (or two lengths that happen
    to be equal) is not made one symbol, then specialized and compiled again when they differ.

    The layer's float attributes (RMSNorm's eps, the attention scale) and int attributes (head_dim,
    the head counts) stay constants: dynamic=True would make the floats graph inputs (the attention
    kernel takes its scale as a Python float), and under FSDP2 the ints symbols. Dynamo keeps a
    plain module's ints constant, but reads an FSDP-managed module's attributes without guards
    (skip_fsdp_guards), and so as symbols: head_dim would be one, and every view and the rotary
    embedding's slices would add floor-division guards, whose reasoning takes most of a compile,
    even with Inductor's cache warm (docs/performance.md, "Why the defaults are what they are";
    docs/performance-details.md, "Compile warm-up on a restart"). skip_fsdp_guards=False treats the
    layer's modules as plain ones (their attributes guarded as usual). The ints the layer takes as
    arguments (the longest sequence, max_length_q) stay symbolic.

    A layer switched to activation checkpointing (set_layer_checkpointing) runs inside torch's
    non-reentrant checkpoint, in training mode with gradients on (as transformers checkpoints its
    layers): the backward recomputes it through the same compiled function (the forward's graphs,
    no eager copy of the layer), routed as the forward was (routing.checkpoint_contexts); module
    hooks (FSDP2's) stay outside the checkpoint."""
    if getattr(layer, "spmd_checkpoint", False) and layer.training and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(functools.partial(_run_compiled_layer, forward, layer, **kwargs), *args, use_reentrant=False,
                          context_fn=checkpoint_contexts)
    return _run_compiled_layer(forward, layer, *args, **kwargs)


def _run_compiled_layer(forward, layer, *args, **kwargs):
    with torch.fx.experimental._config.patch(use_duck_shape=False), \
            torch._dynamo.config.patch(specialize_float=True, skip_fsdp_guards=False):
        return forward(layer, *args, **kwargs)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# Where torch.compile's seconds go, from dynamo's timers (torch._dynamo.utils.compilation_time_metrics):
# metric name -> the timer it sums. "guards": building the compiled frames' guards, after tracing;
# "backend" holds AOTAutograd and Inductor, cache loads included; "cache_load" is the part of it
# spent loading a graph AOTAutograd's cache hit (Inductor's graph and kernels); "load" the part
# spent importing compiled modules (freshly written or from the cache); "lazy_backward" is a backward
# graph compiled at its first backward, outside compile_inner's seconds.
COMPILE_TIMERS = {"perf/compile_trace_s": "bytecode_tracing",
                  "perf/compile_guards_s": "build_guards",
                  "perf/compile_backend_s": "OutputGraph.call_user_compiler",
                  "perf/compile_cache_load_s": "AOTAutogradCache.inductor_load",
                  "perf/compile_load_s": "PyCodeCache.load_by_key_path",
                  "perf/compile_lazy_backward_s": "backward._backward_impl"}


def compile_stats() -> dict[str, float]:
    """This process's torch.compile so far, as step metrics: graphs, seconds spent compiling them
    (dynamo's `_compile.compile_inner`: tracing, AOTAutograd, Inductor, cache loads), those seconds
    split as COMPILE_TIMERS says, and Inductor's FX-graph cache hits and misses. A restart with a
    warm cache shows hits only; its seconds are then tracing and loading."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    stats = {"perf/compiled_graphs": float(compiled_graphs()),
             "perf/compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
             "perf/compile_cache_hits": float(counters["inductor"]["fxgraph_cache_hit"]),
             "perf/compile_cache_misses": float(counters["inductor"]["fxgraph_cache_miss"])}
    for metric, timer in COMPILE_TIMERS.items():
        stats[metric] = float(sum(compilation_time_metrics.get(timer, ())))
    return stats


def compile_line(metrics: dict[str, float]) -> str:
    """One log line from a step's `compile_stats()` metrics."""
    return (f"torch.compile so far: {metrics['perf/compiled_graphs']:.0f} graphs in {metrics['perf/compile_s']:.1f}s "
            f"(tracing {metrics['perf/compile_trace_s']:.1f}s, guards {metrics['perf/compile_guards_s']:.1f}s, "
            f"AOTAutograd + Inductor {metrics['perf/compile_backend_s']:.1f}s of which loading cached graphs "
            f"{metrics['perf/compile_cache_load_s']:.1f}s and importing compiled modules {metrics['perf/compile_load_s']:.1f}s; "
            f"backward compiled at first use {metrics['perf/compile_lazy_backward_s']:.1f}s more; "
            f"Inductor's cache: {metrics['perf/compile_cache_hits']:.0f} hits, "
            f"{metrics['perf/compile_cache_misses']:.0f} misses)")
