"""The engine's one adapter applied with cuBLAS matmuls in vLLM's LoRA layers (rollout.lora_matmul).

vLLM applies LoRA with Punica's two Triton kernels per adapted layer (shrink: x A^T, down to the rank;
expand: + h B^T, into the layer's output), written to serve many adapters in one batch: each token looks
its adapter up. The engine holds one adapter (max_loras = 1, the actor's), and for one adapter a layer's
LoRA is two plain matmuls, whatever its output slices (q/k/v has three, gate/up two):

    h = x @ A^T                 (tokens x slices * rank: every slice's A stacked along the rank)
    h *= on                     (1 where the token's request carries the adapter, else 0; see below)
    y += h @ B^T                (B block-diagonal: slice i's rows read slice i's rank columns only;
                                 one addmm, the add in the matmul's epilogue)

vLLM keeps a tensor per slice; `join_slices` allocates the two buffers of a layer and re-points vLLM's
slice tensors into them (Tensor.set_), so the adapter vLLM loads each step lands in them, nothing copied
per forward. `apply_adapter` is the math (no vLLM in it). `install()` makes vLLM build `OneAdapterPunica`
(vLLM's PunicaWrapperGPU with `add_lora_linear` done by these where it holds one adapter, its kernels
otherwise) through the platform's `get_punica_wrapper`, before the engine is built; a layer's buffers are
joined at its first call, in vLLM's profile run, before CUDA graphs capture the matmuls (not for a model
vLLM compiles, whose first call is traced: the engine installs it with rollout.vllm_compile off only).
The mask `on` is filled from vLLM's token-to-adapter map (index -1: none) at each metadata update,
outside the graphs, into a buffer the graphs read. The engine runs every request with its adapter (it
refuses to generate before one is loaded), so it installs `EveryTokenPunica`, which skips the mask: the
tokens vLLM then runs without an adapter are the padding of a CUDA graph's batch and its dummy runs,
whose outputs nobody reads; that saves a kernel per adapted layer and token step.

Numbers: h is rounded to the adapter's dtype before the expand, as Punica's expand kernel casts its float32
buffer to B's dtype; the add to the base output is rounded once (Punica's kernel rounds the product, then
the sum). vLLM passes scale 1 (its LoRA layers fold alpha / r into B). tests/rollout/vllm/test_lora_matmul.py
checks the math against a float64 reference; tests/gpu/test_lora_gpu.py against vLLM's kernels and the
engine against the actor; docs/performance.md has the generation time either way.
"""

from __future__ import annotations

import torch

WRAPPER = "OneAdapterPunica"
WRAPPER_EVERY_TOKEN = "EveryTokenPunica"


@torch.no_grad()
def join_slices(lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's adapter as two matrices, A [slices * rank, in] (each slice's A stacked along the rank) and
    B [sum of outs, slices * rank] (block-diagonal: slice i's rows, slice i's rank columns), with vLLM's
    stacked slot tensors (`lora_a[i]`: [1, 1, rank, in], `lora_b[i]`: [1, 1, out_i, rank]) re-pointed
    into them in place (values kept): a later write through vLLM's tensors is a write into the matrices,
    and the zeros off the diagonal are never written."""
    rank, fan_in = lora_a[0].shape[-2:]
    outs = [b.shape[-2] for b in lora_b]
    with torch.inference_mode(False):  # plain tensors, whatever mode vLLM runs its profile pass in
        a_all = torch.zeros(len(lora_a) * rank, fan_in, dtype=lora_a[0].dtype, device=lora_a[0].device)
        b_all = torch.zeros(sum(outs), len(lora_b) * rank, dtype=lora_b[0].dtype, device=lora_b[0].device)
        offset, views = 0, []
        for i, n in enumerate(outs):
            views.append((a_all[i * rank:(i + 1) * rank].view(1, 1, rank, fan_in),
                          b_all[offset:offset + n, i * rank:(i + 1) * rank].unsqueeze(0).unsqueeze(0)))
            offset += n
    for a, b, (a_view, b_view) in zip(lora_a, lora_b, views):
        a_view.copy_(a)
        b_view.copy_(b)
        a.set_(a_view)
        b.set_(b_view)
    return a_all, b_all


def apply_adapter(y: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor, scale: float,
                  on: torch.Tensor | None) -> None:
    """y += (x @ a_all^T * scale * on) @ b_all^T, in place: vLLM's add_lora_linear for its adapter slot 0,
    on a layer's joined matrices (join_slices); `on`: [>= tokens, 1], 1 for a token with the adapter, or
    None: every token has it."""
    x = x.view(-1, x.shape[-1])
    h = torch.mm(x, a_all.t())
    if on is not None:
        on = on[: x.size(0)]
        h.mul_(on if scale == 1.0 else on * scale)
    elif scale != 1.0:
        h.mul_(scale)
    y.view(-1, y.shape[-1]).addmm_(h, b_all.t())


def install(every_request_has_adapter: bool = False) -> None:
    """Make vLLM's LoRA layers use OneAdapterPunica, or EveryTokenPunica (no mask) where the engine runs
    every request with its adapter (before the engine is built; vLLM resolves the platform's wrapper by its
    qualified name)."""
    from vllm.platforms import current_platform

    qualname = f"{__name__}.{WRAPPER_EVERY_TOKEN if every_request_has_adapter else WRAPPER}"
    type(current_platform).get_punica_wrapper = classmethod(lambda cls: qualname)


def _wrapper_class(every_token: bool) -> type:
    """OneAdapterPunica: vLLM's PunicaWrapperGPU with one adapter's linear layers done by apply_adapter;
    `every_token`: EveryTokenPunica, the same without the mask."""
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    class OneAdapterPunica(PunicaWrapperGPU):  # vLLM marks it final for its type checker only
        def __init__(self, max_num_batched_tokens: int, max_batches: int, device, **kwargs):
            super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
            dtype = kwargs["lora_config"].lora_dtype  # the model's dtype once vLLM checked the config
            self.adapter_on = None if every_token else torch.zeros(  # the mask; None: every token has the adapter
                max_num_batched_tokens, 1, device=device, dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16)
            self.joined: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a layer's A and B (join_slices)

        def update_metadata(self, *args, **kwargs):
            super().update_metadata(*args, **kwargs)
            if self.adapter_on is not None:
                self.adapter_on.copy_((self._token_lora_indices >= 0).unsqueeze(1))

        def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                            **kwargs):
            if self.max_loras != 1:
                return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                               buffer=buffer, **kwargs)
            joined = self.joined.get(id(lora_a_stacked))  # vLLM's layer keeps its tuple for the engine's life
            if joined is None:
                joined = self.joined[id(lora_a_stacked)] = join_slices(lora_a_stacked, lora_b_stacked)
            on = self.adapter_on
            if on is not None and on.dtype != x.dtype:
                on = on.to(x.dtype)
            apply_adapter(y, x, *joined, scale, on)  # y is zeros where vLLM asks for the adapter's part alone

    OneAdapterPunica.__qualname__ = OneAdapterPunica.__name__ = WRAPPER_EVERY_TOKEN if every_token else WRAPPER
    OneAdapterPunica.__module__ = __name__
    return OneAdapterPunica


def __getattr__(name: str):
    """The wrapper class, built at its first lookup (vLLM's resolve_obj_by_qualname): this module
    imports without vLLM."""
    if name in (WRAPPER, WRAPPER_EVERY_TOKEN):
        globals()[name] = _wrapper_class(every_token=name == WRAPPER_EVERY_TOKEN)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
