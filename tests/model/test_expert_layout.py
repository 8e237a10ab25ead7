"""A mixture's experts in the checkpoint's layout (spmd_rl.model.expert_layout): the names and values
transformers' `save_pretrained` writes for the same model, the independent reference."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from spmd_rl.model.expert_layout import iter_per_expert, per_expert
from spmd_rl.model.loading import preset_config


@pytest.mark.parametrize("arch", ["glm4-moe-lite-tiny", "qwen3-moe-tiny"])
def test_per_expert_gives_what_save_pretrained_writes(arch, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(arch), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ours = dict(iter_per_expert(model.state_dict().items()))
    ours.pop("lm_head.weight")  # tied to the embedding: save_pretrained keeps the embedding only
    assert any(".experts.0.gate_proj.weight" in n for n in saved)  # the reference lists each expert
    assert sorted(ours) == sorted(saved)
    for name, t in saved.items():
        assert torch.equal(ours[name], t), name


def test_dense_and_non_expert_tensors_pass_as_they_are():
    shared = torch.randn(4, 3)
    assert per_expert("model.layers.0.mlp.shared_experts.down_proj.weight", shared)[0][1] is shared
    assert per_expert("model.layers.0.self_attn.q_proj.weight", shared) == [
        ("model.layers.0.self_attn.q_proj.weight", shared)]


def test_fused_experts_become_views_in_order():
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # 2 experts, intermediate 2, hidden 3
    out = per_expert("model.layers.1.mlp.experts.gate_up_proj", gate_up)
    assert [n for n, _ in out] == [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("gate", "up")]
    assert torch.equal(out[1][1], gate_up[0, 2:]) and torch.equal(out[2][1], gate_up[1, :2])
    assert all(t.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr() for _, t in out)  # nothing copied

