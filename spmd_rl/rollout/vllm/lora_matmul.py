"""The engine's one adapter applied with cuBLAS matmuls in vLLM's LoRA layers (rollout.lora_matmul).

vLLM applies LoRA with Punica's two Triton kernels per adapted layer (shrink: x A^T, down to the rank;
expand: + h B^T, into the layer's output), written to serve many adapters in one batch: each token looks
its adapter up. The engine holds one adapter (max_loras = 1, the actor's), and for one adapter a layer's
LoRA is two plain matmuls per output slice (q/k/v has three, gate/up two):

    h = x @ A^T                 (tokens x rank)
    h *= on                     (1 where the token's request carries the adapter, else 0)
    y[:, slice] += h @ B^T      (one addmm, the add in the matmul's epilogue)

`apply_adapter` is that math (no vLLM in it). `install()` makes vLLM build `OneAdapterPunica` (vLLM's
PunicaWrapperGPU with `add_lora_linear` done by `apply_adapter` where it holds one adapter, its kernels
otherwise) through the platform's `get_punica_wrapper`, before the engine is built: its CUDA graphs then
capture the matmuls. The mask `on` is filled from vLLM's token-to-adapter map (index -1: none) at each
metadata update, outside the graphs, into a buffer the graphs read.

Numbers: h is rounded to the adapter's dtype before the expand, as Punica's expand kernel casts its float32
buffer to B's dtype; the add to the base output is rounded once (Punica's kernel rounds the product, then
the sum). vLLM passes scale 1 (its LoRA layers fold alpha / r into B). tests/rollout/vllm/test_lora_matmul.py
checks the math against a float64 reference; tests/gpu/test_lora_gpu.py the engine against the actor;
docs/performance.md has the generation time either way.
"""

from __future__ import annotations

import torch

WRAPPER = "OneAdapterPunica"


def apply_adapter(y: torch.Tensor, x: torch.Tensor, lora_a: tuple[torch.Tensor, ...], lora_b: tuple[torch.Tensor, ...],
                  scale: float, output_slices: tuple[int, ...], on: torch.Tensor) -> None:
    """y[:, slice i] += (x @ A_i^T * scale * on) @ B_i^T for each slice, in place: vLLM's
    add_lora_linear for its adapter slot 0. `lora_a[i]`: [max_loras, 1, rank, in] (vLLM's stacked
    A), `lora_b[i]`: [max_loras, 1, out_i, rank]; `on`: [>= tokens, 1], 1 for a token with the adapter."""
    x = x.view(-1, x.shape[-1])
    y2 = y.view(-1, y.shape[-1])
    on = on[: x.size(0)]
    offset = 0
    for a, b, width in zip(lora_a, lora_b, output_slices):
        h = torch.mm(x, a[0, 0].t())
        h.mul_(on if scale == 1.0 else on * scale)
        y2[:, offset:offset + width].addmm_(h, b[0, 0].t())
        offset += width


def install() -> None:
    """Make vLLM's LoRA layers use OneAdapterPunica (before the engine is built; vLLM resolves the
    platform's wrapper by its qualified name)."""
    from vllm.platforms import current_platform

    qualname = f"{__name__}.{WRAPPER}"
    type(current_platform).get_punica_wrapper = classmethod(lambda cls: qualname)


def _wrapper_class() -> type:
    """OneAdapterPunica: vLLM's PunicaWrapperGPU with one adapter's linear layers done by apply_adapter."""
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    class OneAdapterPunica(PunicaWrapperGPU):  # vLLM marks it final for its type checker only
        def __init__(self, max_num_batched_tokens: int, max_batches: int, device, **kwargs):
            super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
            dtype = kwargs["lora_config"].lora_dtype  # the model's dtype once vLLM checked the config
            self.adapter_on = torch.zeros(max_num_batched_tokens, 1, device=device,
                                          dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16)

        def update_metadata(self, *args, **kwargs):
            super().update_metadata(*args, **kwargs)
            self.adapter_on.copy_((self._token_lora_indices >= 0).unsqueeze(1))

        def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                            **kwargs):
            if self.max_loras != 1 or not kwargs.get("add_inputs", True):
                return super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                               buffer=buffer, **kwargs)
            on = self.adapter_on if self.adapter_on.dtype == x.dtype else self.adapter_on.to(x.dtype)
            apply_adapter(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, on)

    OneAdapterPunica.__qualname__ = WRAPPER
    OneAdapterPunica.__module__ = __name__
    return OneAdapterPunica


def __getattr__(name: str):
    """The wrapper class, built at its first lookup (vLLM's resolve_obj_by_qualname): this module
    imports without vLLM."""
    if name == WRAPPER:
        globals()[name] = _wrapper_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
