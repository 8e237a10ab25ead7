"""spmd_rl/rollout/vllm/lora_matmul.py: one adapter's LoRA as plain matmuls, against a float64 reference
of vLLM's add_lora_linear semantics (the GPU test against vLLM's own kernels: tests/gpu/test_lora_gpu.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from spmd_rl.rollout.vllm import lora_matmul


def stacked(rank: int, fan_in: int, outs: tuple[int, ...], dtype, gen) -> tuple[tuple, tuple]:
    """vLLM's stacked adapter slot tensors: A [1, 1, rank, in] and B [1, 1, out, rank] per slice."""
    a = tuple(torch.randn(1, 1, rank, fan_in, generator=gen, dtype=dtype) / fan_in ** 0.5 for _ in outs)
    b = tuple(torch.randn(1, 1, out, rank, generator=gen, dtype=dtype) / rank ** 0.5 for out in outs)
    return a, b


def reference(y, x, a, b, scale, outs, has_adapter):
    """vLLM's add_lora_linear as its docstring states it, in float64, token by token's mask."""
    y = y.double().clone()
    offset = 0
    for ai, bi, width in zip(a, b, outs):
        lora = (x.double() @ ai[0, 0].double().t() * scale) @ bi[0, 0].double().t()
        y[:, offset:offset + width] += lora * has_adapter.double().unsqueeze(1)
        offset += width
    return y


@pytest.mark.parametrize("outs", [(48, 16, 16), (40, 40), (24,)], ids=["qkv", "gate_up", "o"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_each_slice_gets_its_adapter_product_and_tokens_without_one_get_none(outs, scale):
    gen = torch.Generator().manual_seed(0)
    tokens, fan_in, rank = 11, 24, 8
    x = torch.randn(tokens, fan_in, generator=gen, dtype=torch.float64)
    y0 = torch.randn(tokens, sum(outs), generator=gen, dtype=torch.float64)
    a, b = stacked(rank, fan_in, outs, torch.float64, gen)
    has_adapter = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    on = torch.zeros(16, 1, dtype=torch.float64)  # the wrapper's buffer: longer than the batch
    on[:tokens, 0] = has_adapter.double()
    y = y0.clone()
    lora_matmul.apply_adapter(y, x, a, b, scale, outs, on)
    assert torch.allclose(y, reference(y0, x, a, b, scale, outs, has_adapter), rtol=0, atol=1e-12)
    assert torch.equal(y[~has_adapter], y0[~has_adapter])  # no adapter: the base output untouched


def test_bf16_is_as_close_to_the_float64_reference_as_one_rounding_of_each_product():
    gen = torch.Generator().manual_seed(1)
    outs, tokens, fan_in, rank = (64, 16, 16), 32, 128, 16
    x = torch.randn(tokens, fan_in, generator=gen).bfloat16()
    y0 = torch.randn(tokens, sum(outs), generator=gen).bfloat16()
    a, b = stacked(rank, fan_in, outs, torch.bfloat16, gen)
    on = torch.ones(tokens, 1, dtype=torch.bfloat16)
    y = y0.clone()
    lora_matmul.apply_adapter(y, x, a, b, 1.0, outs, on)
    want = reference(y0, x, a, b, 1.0, outs, torch.ones(tokens, dtype=torch.bool))
    lora = want - y0.double()
    # h rounded to bf16 before the expand, then the sum rounded once: a few bf16 ulps of the output
    assert (y.double() - want).abs().max() <= 4 * 2 ** -8 * want.abs().max()
    assert (y.double() - y0.double()).sub(lora).abs().mean() < 0.05 * lora.abs().mean()


def test_the_module_imports_without_vllm_and_names_its_wrapper_lazily():
    module = importlib.reload(lora_matmul)
    assert "OneAdapterPunica" not in vars(module)  # built at vLLM's lookup, which imports vLLM
    with pytest.raises(AttributeError):
        module.NoSuchWrapper
