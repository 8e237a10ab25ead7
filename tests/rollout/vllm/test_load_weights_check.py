"""The vLLM engine's check that a weight stream set every engine parameter (VLLMEngine.load_weights,
strict): `unset_parameters` against the names vLLM 0.26's loaders return.

No vLLM here: the modules below have the parameter layout of vLLM 0.26's Qwen3-MoE model (a fused-MoE
layer `mlp.experts` whose weights live in its `routed_experts` child) and the names its
`AutoWeightsLoader` returns for them (`MoERunner.load_weights` at `mlp.experts` yields the child's own
names, `w13_weight`, so they come back one level short). The GPU proof: tests/gpu/test_moe_gpu.py.
"""

import pytest
import torch
from torch import nn

from spmd_rl.rollout.vllm.engine import unset_parameters


class RoutedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(4, 6, 3))
        self.w2_weight = nn.Parameter(torch.zeros(4, 3, 3))


class MoERunner(nn.Module):
    def __init__(self):
        super().__init__()
        self.routed_experts = RoutedExperts()


class MoeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(3, 4, bias=False)
        self.experts = MoERunner()


def moe_model(layers=2):
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.mlp = MoeBlock()
        model.layers.append(layer)
    return model


def reported_by_vllm(layers=2, skip=()):
    names = set()
    for i in range(layers):
        names.add(f"layers.{i}.mlp.gate.weight")
        for w in ("w13_weight", "w2_weight"):
            if (i, w) not in skip:
                names.add(f"layers.{i}.mlp.experts.{w}")  # one level short of routed_experts
    return names


def test_moe_expert_weights_reported_one_level_short_count_as_set():
    assert unset_parameters(moe_model(), reported_by_vllm()) == []


def test_an_expert_weight_the_stream_lacked_is_still_found():
    missing = unset_parameters(moe_model(), reported_by_vllm(skip={(1, "w2_weight")}))
    assert missing == ["layers.1.mlp.experts.routed_experts.w2_weight"]


def test_only_the_level_just_above_the_parameter_may_be_missing():
    """A name two levels short (or a different module's) is no report of the parameter."""
    model = moe_model(1)
    loaded = {"layers.0.mlp.gate.weight", "layers.0.w13_weight", "layers.0.mlp.w2_weight"}
    assert unset_parameters(model, loaded) == ["layers.0.mlp.experts.routed_experts.w13_weight",
                                               "layers.0.mlp.experts.routed_experts.w2_weight"]


def test_dense_names_are_checked_exactly():
    model = nn.Module()
    model.embed = nn.Embedding(3, 2)
    model.head = nn.Linear(2, 3)
    assert unset_parameters(model, {"embed.weight", "head.weight", "head.bias"}) == []
    assert unset_parameters(model, {"embed.weight", "head.weight"}) == ["head.bias"]


def stand_in_engine():
    """A VLLMEngine without vLLM: load_weights' own logic on a model that inner_model gives."""
    from types import SimpleNamespace

    from spmd_rl.rollout.vllm import engine as vllm_engine

    engine = object.__new__(vllm_engine.VLLMEngine)
    engine._awake, engine.lora, engine.llm = {"weights"}, None, None
    engine.cfg = SimpleNamespace(rollout=SimpleNamespace(dtype="bfloat16"))
    return engine


class LoadingMoERunner(MoERunner):
    """vLLM 0.26's MoERunner.load_weights: the layer's fused tensors under their last names, the loaded
    parameters reported under its routed_experts child's own names (w13_weight)."""

    def load_weights(self, weights):
        for proj, tensor in weights:
            param = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}[proj]
            getattr(self.routed_experts, param).data.copy_(tensor)
            yield param


def glm_like_model():
    """A mixture whose model-level loader, like vLLM 0.26's glm4_moe_lite with any LoRA layer in the
    engine, finds no parameter for an expert tensor (a KeyError), whatever its layout."""
    model = nn.Module()
    model.model = moe_model(2)
    for layer in model.model.layers:
        layer.mlp.experts = LoadingMoERunner()
    model.received = []

    def load_weights(weights):
        names = set()
        for name, t in weights:
            model.received.append(name)
            if ".experts." in name:
                raise KeyError(name)
            model.get_parameter(name).data.copy_(t)
            names.add(name)
        return names

    model.load_weights = load_weights
    return model


def test_fused_experts_reach_their_layers_own_loader_and_count_as_set(monkeypatch):
    """VLLMEngine.load_weights gives each fused expert tensor to its fused-MoE layer's own loader, whole,
    under LoRA (attention layers wrapped) too; the rest of the stream goes to the model's loader, and the
    experts' parameters count as set. A fused name with no fused-MoE layer of that name goes to the model."""
    from spmd_rl.rollout.vllm import engine as vllm_engine

    model = glm_like_model()
    monkeypatch.setattr(vllm_engine, "inner_model", lambda llm: model)
    monkeypatch.setattr(vllm_engine, "expert_layers", lambda: (LoadingMoERunner,))
    stream = [(f"model.layers.{i}.mlp.gate.weight", torch.full((4, 3), 1.0 + i)) for i in range(2)]
    stream += [(f"model.layers.{i}.mlp.experts.{p}", torch.full(shape, 10.0 * i + k))
               for i in range(2) for k, (p, shape) in enumerate([("gate_up_proj", (4, 6, 3)), ("down_proj", (4, 3, 3))])]
    for lora in (None, object()):
        engine = stand_in_engine()
        engine.lora, engine._wrapped = lora, {"model.layers.0.self_attn.q_proj"}
        model.received.clear()
        engine.load_weights(iter(stream))
        assert model.received == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
        experts = model.model.layers[1].mlp.experts.routed_experts
        assert torch.equal(experts.w13_weight, torch.full((4, 6, 3), 10.0))
        assert torch.equal(experts.w2_weight, torch.full((4, 3, 3), 11.0))
    with pytest.raises(KeyError, match="layers.2.mlp.experts.down_proj"):  # no such layer: the model's loader
        stand_in_engine().load_weights(iter(stream + [("model.layers.2.mlp.experts.down_proj", torch.zeros(4, 3, 3))]))


class LatentAttention(nn.Module):
    """vLLM 0.26's MLAAttention's parameters: kv_b_proj loaded, W_UK_T and W_UV derived from it after
    loading (its process_weights_after_loading)."""

    def __init__(self):
        super().__init__()
        self.kv_b_proj = nn.Linear(2, 6, bias=False)
        self.W_UK_T = nn.Parameter(torch.zeros(2, 3))
        self.W_UV = nn.Parameter(torch.zeros(3, 2))
        self.dtypes = []

    def process_weights_after_loading(self, act_dtype):
        self.dtypes.append(act_dtype)
        w = self.kv_b_proj.weight.detach()
        self.W_UK_T.data.copy_(w[:3].T)
        self.W_UV.data.copy_(w[3:])


def test_the_engine_computes_the_weights_vllm_derives_after_every_load(monkeypatch):
    """After a load, a latent attention's W_UK_T and W_UV are computed again from the new kv_b_proj
    (and so count as set); without that step they would hold the weights before the load."""
    from spmd_rl.rollout.vllm import engine as vllm_engine

    model = nn.Module()
    model.attn = LatentAttention()

    def load_weights(weights):
        names = set()
        for name, t in weights:
            model.get_parameter(name).data.copy_(t)
            names.add(name)
        return names

    model.load_weights = load_weights
    monkeypatch.setattr(vllm_engine, "inner_model", lambda llm: model)
    monkeypatch.setattr(vllm_engine, "derived_weight_layers", lambda: (LatentAttention,))
    new = torch.arange(12.0).reshape(6, 2)
    stand_in_engine().load_weights(iter([("attn.kv_b_proj.weight", new)]))
    assert torch.equal(model.attn.W_UK_T, new[:3].T) and torch.equal(model.attn.W_UV, new[3:])
    assert model.attn.dtypes == [torch.bfloat16]
    monkeypatch.setattr(vllm_engine, "derived_weight_layers", lambda: ())  # a layer vLLM does not derive
    with pytest.raises(RuntimeError, match="left 2 engine parameters unset"):
        stand_in_engine().load_weights(iter([("attn.kv_b_proj.weight", new)]))
