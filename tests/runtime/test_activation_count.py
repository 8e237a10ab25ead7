"""The memory plan's per-token counts of a compiled decoder layer's saved tensors (spmd_rl/runtime/memory_plan.py:
SWIGLU_VALUES_PER_INTERMEDIATE, expert_activation_bytes), counted here on CPU.

The layer is compiled as the presets run it (`model.fused_kernels = "compile"`); a saved-tensors hook records
every tensor autograd keeps from the layer's forward. Two models that differ in one size give the bytes that
size costs: a dense MLP's intermediate size, a mixture's top-k. Only compute-dtype (bf16) tensors are counted:
the router's float32 scores and integer indices are the plan's router term, not the per-copy one.
"""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.model import fused_kernels
from spmd_rl.model.loading import preset_config
from spmd_rl.runtime import memory_plan as mp

TOKENS = 256


def saved_compute_bytes(arch: str, frozen_experts: bool = False, **sizes) -> int:
    """Bytes of the bf16 tensors one compiled decoder layer keeps for backward over TOKENS tokens
    (`frozen_experts`: a mixture's experts take no gradient, as under LoRA)."""
    config = preset_config(arch)
    config.num_hidden_layers = 1
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if frozen_experts and ".mlp.experts." in name:
            p.requires_grad_(False)
    fused_kernels.apply(model, "compile", device_type="cpu")
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [False], {}
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and t.dtype == torch.bfloat16 and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, position_ids=torch.arange(TOKENS)[None])
    return sum(seen.values())


def test_a_dense_swiglu_mlp_keeps_three_values_per_unit_of_intermediate_size():
    """Doubling a Qwen2 layer's intermediate size adds SWIGLU_VALUES_PER_INTERMEDIATE bf16 values per token and
    unit (the gate and up outputs and their product)."""
    small = saved_compute_bytes("tiny", intermediate_size=128)
    large = saved_compute_bytes("tiny", intermediate_size=256)
    assert large - small == TOKENS * mp.SWIGLU_VALUES_PER_INTERMEDIATE * 128 * 2


def test_each_routed_copy_keeps_what_expert_activation_bytes_counts():
    """Top-4 against top-2 on the tiny mixture: the two more copies of each token cost what expert_activation_bytes
    adds for them (each copy's permuted input and output, routing weight and SwiGLU values in bf16)."""
    top2 = saved_compute_bytes("qwen3-moe-tiny", num_experts_per_tok=2)
    top4 = saved_compute_bytes("qwen3-moe-tiny", num_experts_per_tok=4)
    shape = mp.shape_from_config(preset_config("qwen3-moe-tiny").to_dict())
    work = mp.Work(update_tokens=TOKENS, forward_tokens=TOKENS)
    counted = [mp.expert_activation_bytes(dataclasses.replace(shape, experts_per_token=k), TOKENS, work) for k in (2, 4)]
    assert top4 - top2 == counted[1] - counted[0]


def test_a_frozen_experts_routed_copy_keeps_neither_its_input_nor_its_swiglu_product():
    """LoRA on a mixture (its attention adapted, the experts frozen): no weight gradient reads an expert's
    permuted input or its activated SwiGLU product, so a routed copy keeps hidden + 1 + 2 x moe_intermediate_size
    values (Work.base_trained = False)."""
    top2 = saved_compute_bytes("qwen3-moe-tiny", frozen_experts=True, num_experts_per_tok=2)
    top4 = saved_compute_bytes("qwen3-moe-tiny", frozen_experts=True, num_experts_per_tok=4)
    shape = mp.shape_from_config(preset_config("qwen3-moe-tiny").to_dict())
    work = mp.Work(update_tokens=TOKENS, forward_tokens=TOKENS, base_trained=False)
    counted = [mp.expert_activation_bytes(dataclasses.replace(shape, experts_per_token=k), TOKENS, work) for k in (2, 4)]
    assert top4 - top2 == counted[1] - counted[0] == TOKENS * 2 * (64 + 1 + 2 * 32) * 2


@pytest.mark.parametrize("arch,qk_norm", [("tiny", False), ("qwen3-moe-tiny", True)])
def test_an_attention_keeps_its_counted_values_per_unit_of_query_and_key_value_width(arch, qk_norm):
    """Doubling the query heads, then the key-value heads (head_dim fixed): each unit of width adds
    ATTENTION_VALUES_PER_HEAD_UNIT values per token (Qwen2's attention 2; Qwen3's, with query-key norms, 3),
    what memory_plan.attention_extra_values counts beyond the fitted constant."""
    sizes = dict(head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    base = saved_compute_bytes(arch, **sizes)
    wider_q = saved_compute_bytes(arch, **{**sizes, "num_attention_heads": 8})
    wider_kv = saved_compute_bytes(arch, **{**sizes, "num_attention_heads": 8, "num_key_value_heads": 4})
    per_unit = mp.ATTENTION_VALUES_PER_HEAD_UNIT[qk_norm] * TOKENS * 2  # bf16
    assert wider_q - base == 4 * 16 * per_unit and wider_kv - wider_q == 2 * 16 * per_unit
    shape = mp.shape_from_config(preset_config(arch).to_dict())
    assert shape.qk_norm is qk_norm
