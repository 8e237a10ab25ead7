"""spmd_rl/rollout/vllm/lora_matmul.py: one adapter's LoRA as plain matmuls, against a float64 reference
of vLLM's add_lora_linear semantics (the GPU test against vLLM's own kernels: tests/gpu/test_lora_gpu.py)."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from spmd_rl.rollout.vllm import lora_matmul
from tests.helpers.stand_in_vllm import VLLM_WRAPPER, stand_in_engine


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


def load(a, b, gen, rank_used=None):
    """New adapter values written as vLLM's set_lora writes them: through its slice tensors, zeroed
    first, then copied into the top-left [rank_used, in] / [out, rank_used] corner."""
    for t in (*a, *b):
        t[0] = 0
    for ai in a:
        r = rank_used or ai.shape[-2]
        ai[0, 0, :r].copy_(torch.randn(r, ai.shape[-1], generator=gen, dtype=ai.dtype))
    for bi in b:
        r = rank_used or bi.shape[-1]
        bi[0, 0, :, :r].copy_(torch.randn(bi.shape[-2], r, generator=gen, dtype=bi.dtype) / 4)


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
    want = reference(y0, x, a, b, scale, outs, has_adapter)  # before joining: the values vLLM holds
    joined = lora_matmul.join_slices(a, b)
    y = y0.clone()
    lora_matmul.apply_adapter(y, x, *joined, scale, on)
    assert torch.allclose(y, want, rtol=0, atol=1e-12)
    assert torch.equal(y[~has_adapter], y0[~has_adapter])  # no adapter: the base output untouched
    every = lora_matmul.join_slices(a, b)  # EveryTokenPunica's call: no mask, every token gets the product
    y = y0.clone()
    lora_matmul.apply_adapter(y, x, *every, scale, None)
    want_every = reference(y0, x, a, b, scale, outs, torch.ones(tokens, dtype=torch.bool))
    assert torch.allclose(y, want_every, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rank_used", [None, 5], ids=["full-rank", "rank-below-vllms-max"])
def test_adapters_loaded_later_through_vllms_slice_tensors_land_in_the_joined_matrices(rank_used):
    gen = torch.Generator().manual_seed(2)
    outs, tokens, fan_in, rank = (48, 16, 16), 9, 24, 8
    x = torch.randn(tokens, fan_in, generator=gen, dtype=torch.float64)
    y0 = torch.randn(tokens, sum(outs), generator=gen, dtype=torch.float64)
    a, b = stacked(rank, fan_in, outs, torch.float64, gen)
    a_all, b_all = lora_matmul.join_slices(a, b)
    on = torch.ones(tokens, 1, dtype=torch.float64)
    for step in range(3):  # each step vLLM loads the new adapter into its slot
        load(a, b, gen, rank_used)
        y = y0.clone()
        lora_matmul.apply_adapter(y, x, a_all, b_all, 1.0, on)
        want = reference(y0, x, a, b, 1.0, outs, torch.ones(tokens, dtype=torch.bool))
        assert torch.allclose(y, want, rtol=0, atol=1e-12), step
    off_diagonal = torch.ones_like(b_all, dtype=torch.bool)
    offset = 0
    for i, n in enumerate(outs):
        off_diagonal[offset:offset + n, i * rank:(i + 1) * rank] = False
        offset += n
    assert not b_all[off_diagonal].any()  # slice i's outputs never read another slice's rank columns


def test_bf16_is_as_close_to_the_float64_reference_as_one_rounding_of_each_product():
    gen = torch.Generator().manual_seed(1)
    outs, tokens, fan_in, rank = (64, 16, 16), 32, 128, 16
    x = torch.randn(tokens, fan_in, generator=gen).bfloat16()
    y0 = torch.randn(tokens, sum(outs), generator=gen).bfloat16()
    a, b = stacked(rank, fan_in, outs, torch.bfloat16, gen)
    on = torch.ones(tokens, 1, dtype=torch.bfloat16)
    want = reference(y0, x, a, b, 1.0, outs, torch.ones(tokens, dtype=torch.bool))
    y = y0.clone()
    lora_matmul.apply_adapter(y, x, *lora_matmul.join_slices(a, b), 1.0, on)
    lora = want - y0.double()
    # h rounded to bf16 before the expand, then the sum rounded once: a few bf16 ulps of the output
    assert (y.double() - want).abs().max() <= 4 * 2 ** -8 * want.abs().max()
    assert (y.double() - y0.double()).sub(lora).abs().mean() < 0.05 * lora.abs().mean()


def test_the_module_imports_without_vllm_and_names_its_wrapper_lazily():
    module = importlib.reload(lora_matmul)
    assert {"OneAdapterPunica", "EveryTokenPunica"}.isdisjoint(vars(module))  # built at vLLM's lookup, which imports vLLM
    with pytest.raises(AttributeError):
        module.NoSuchWrapper


class _RecordingLLM:
    """Stands in for vllm.LLM: records the LoRA wrapper vLLM's platform names when the engine builds it."""
    seen: list = []

    def __init__(self, **kwargs):
        _RecordingLLM.seen.append(sys.modules["vllm.platforms"].current_platform.get_punica_wrapper())

    def sleep(self, level):
        pass


QWEN_CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=256)
OURS = f"{lora_matmul.__name__}.{lora_matmul.WRAPPER_EVERY_TOKEN}"  # the engine runs every request with its adapter


@pytest.mark.parametrize("overrides, wrapper", [
    ([], OURS),
    (["rollout.lora_matmul=false"], VLLM_WRAPPER),
    (["rollout.vllm_compile=true"], VLLM_WRAPPER),  # a compiled model's first call is traced: no re-pointing there
    (["model.lora_rank=0"], VLLM_WRAPPER),
], ids=["adapter-sync", "lora-matmul-off", "vllm-compile", "no-lora"])
def test_the_engine_has_vllm_build_the_wrapper_with_the_adapter_sync(monkeypatch, tmp_path, caplog, overrides, wrapper):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    lora = ["model.lora_rank=32", 'model.lora_sync="adapter"', "rollout.tensor_parallel_size=1"]
    with caplog.at_level(logging.INFO), stand_in_engine(monkeypatch, tmp_path, _RecordingLLM,
                                                        type("SamplingParams", (), {}), [*lora, *overrides], QWEN_CONFIG):
        pass
    assert _RecordingLLM.seen[-1] == wrapper
    said = [r.getMessage() for r in caplog.records if "cuBLAS matmuls" in r.getMessage()]
    assert len(said) == (wrapper == OURS)
