"""LoRA on the actor, built with PEFT: the adapter, its switch, and the merged weights for an engine.

PEFT's `inject_adapter_in_model` puts a `lora.Linear` around each targeted linear layer of the
loaded transformers model, in place: the model stays the root (the log-prob head, fused kernels,
FSDP2's per-layer units, sequence parallelism and the meta-device build see the same model), and
its parameter names change only inside the adapted layers (`q_proj.weight` becomes
`q_proj.base_layer.weight`, next to `q_proj.lora_A.default.weight` and `q_proj.lora_B.default.weight`).

Dtypes under FSDP2: the frozen base keeps the dtype it was loaded in (the compute dtype: bf16 on
GPU, so no fp32 copy, gradient or optimizer state of it exists) and the adapter is cast to the
master dtype (fp32). One `fully_shard` unit per decoder layer holds both: FSDP2 (torch 2.13,
_fsdp_param_group._init_mp_dtypes) asks for one dtype among the parameters that require grad only,
here the adapter's; its all-gather casts every parameter to the policy's param dtype (mixed inputs
would go through its uint8 path). On one rank the frozen base stays out of FSDP2
(loading.frozen_kept_whole). tests/model/test_lora.py checks both on 1 and 2 ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch

ALL_LINEAR = "all-linear"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.26 takes for max_lora_rank (vllm/config/lora.py, MaxLoRARanks)."""
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]
ADAPTER = "default"  # PEFT's adapter name; one adapter per model
BASE_LAYER = ".base_layer."
ADAPTER_PARTS = (".lora_A.", ".lora_B.")


class LoraSettings(NamedTuple):
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # () = every linear layer of the decoder
    adapter_dtype: torch.dtype  # the trainable adapter's storage (the master dtype)

    @classmethod
    def of(cls, model_cfg, adapter_dtype: torch.dtype) -> "LoraSettings":
        """The [model] section's LoRA keys (rank, alpha, targets), the adapter stored in `adapter_dtype`."""
        return cls(model_cfg.lora_rank, model_cfg.lora_alpha, tuple(model_cfg.lora_target_modules), adapter_dtype)


def peft_problem() -> str | None:
    """Why PEFT cannot be used here (None: it can)."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        return f"peft is not installed ({e})"
    return None


def peft_targets(target_modules: tuple[str, ...] | list[str]) -> str | list[str]:
    """model.lora_target_modules as PEFT's LoraConfig takes it."""
    targets = list(target_modules)
    return ALL_LINEAR if not targets or targets == [ALL_LINEAR] else targets


def is_mixture(model: torch.nn.Module) -> bool:
    """Whether `model` (a transformers causal LM, on the meta device too) has fused experts."""
    return any(".experts." in name for name, _ in model.named_parameters())


def adapted_modules(target_modules: tuple[str, ...] | list[str], model: torch.nn.Module) -> list[str]:
    """The modules an adapter of model.lora_target_modules adapts in `model` (a transformers causal LM,
    on the meta device too), as PEFT's target_modules: the named ones, or for [] ("all-linear") the
    last names of every linear layer (`nn.Linear`) of the decoder; of a mixture of experts, of its
    attention. A mixture's fused experts and router are not linear layers and stay frozen; its MLP names
    (a dense layer's, a shared expert's) are left out too, as PEFT maps gate_proj, up_proj and down_proj
    on a mixture to the fused experts (PEFT's own "all-linear" adapts those as well: docs/moe.md)."""
    targets = peft_targets(target_modules)
    if targets != ALL_LINEAR:
        return targets
    names = decoder_linear_names(model)
    if is_mixture(model):
        names = [n for n in names if not n.startswith("mlp.")]
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def lora_config(settings: LoraSettings, model: torch.nn.Module):
    """PEFT's LoraConfig of `settings` for `model` (its targets resolved by adapted_modules)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                      target_modules=adapted_modules(settings.target_modules, model), bias="none")


def add_adapter(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """PEFT's LoRA layers in `model`, in place (on the meta device too); every other parameter
    frozen in the dtype it has, the adapter in `settings.adapter_dtype`. Returns `model`."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora_config(settings, model), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.data = p.data.to(settings.adapter_dtype)
        p.requires_grad_(is_adapter(name))
    model.spmd_lora = settings
    return model


def has_adapter(model: torch.nn.Module) -> bool:
    return getattr(model, "spmd_lora", None) is not None


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is part of a LoRA adapter (trained) rather than the base (frozen)."""
    return any(part in name for part in ADAPTER_PARTS)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> PEFT LoRA layer, for every adapted layer."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model as its base alone (PEFT's switch on each LoRA layer): the reference policy, for
    no-grad forwards. PEFT's switch also freezes the adapter; the adapter stays trainable here:
    FSDP2 takes a unit's trainable parameters and their dtype at its first forward (lazy init), and
    a reference pass first (step 1) left the adapter without gradients, or with bf16 ones."""
    layers = lora_layers(model).values()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def group_of(name: str) -> str:
    """The LoRA layer a parameter belongs to ("" outside them): its base weight and adapter are
    merged together, so they travel in one bucket."""
    for part in (BASE_LAYER, *ADAPTER_PARTS):
        if part in name:
            return name.split(part)[0]
    return ""


def base_name(name: str) -> str:
    """The transformers name of a base parameter (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return name.replace(BASE_LAYER, ".")


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Module name -> the adapter's scale (lora_alpha / r, as PEFT computes it)."""
    return {name: layer.scaling[ADAPTER] for name, layer in lora_layers(model).items()}


def merge(named: list[tuple[str, torch.Tensor]], scale: dict[str, float],
          dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Full tensors of base and adapter -> transformers-named weights of `dtype`, each adapted
    weight W + scale * B @ A computed in float32 from the float32 adapter, then cast."""
    tensors = dict(named)
    out = []
    for name, t in named:
        if is_adapter(name):
            continue
        layer = group_of(name)
        if layer in scale and name == f"{layer}{BASE_LAYER}weight":
            a = tensors[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = tensors[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            t = torch.addmm(t.float(), b, a, alpha=scale[layer])
        out.append((base_name(name), t.to(dtype)))
    return out


def peft_tensor_name(name: str) -> str:
    """An adapter parameter's name as PEFT saves it (adapter_model.safetensors) and vLLM's LoRA loader
    parses it: `model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def engine_adapter_name(peft_name: str) -> str:
    """The inverse of peft_tensor_name: the parameter of a model with PEFT's layers injected."""
    name = peft_name.removeprefix("base_model.model.")
    for part in ADAPTER_PARTS:
        name = name.replace(part, f"{part}{ADAPTER}.")
    return name


def adapter_config(settings: LoraSettings, targets: list[str]) -> dict:
    """The adapter's adapter_config.json entries that an engine reads (vLLM's PEFTHelper.from_dict);
    `targets`: the modules it adapts (adapted_modules)."""
    return {"r": settings.rank, "lora_alpha": settings.alpha, "target_modules": targets,
            "bias": "none", "use_rslora": False, "use_dora": False}


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def base_layer_name(name: str, wrapped: set[str]) -> str:
    """A transformers weight name as an engine whose module `m` in `wrapped` is a LoRA layer names it:
    `m.weight` -> `m.base_layer.weight` (its own parameters stay on the wrapped base layer)."""
    module, _, leaf = name.rpartition(".")
    return f"{module}{BASE_LAYER}{leaf}" if module in wrapped else name


def engine_target_modules(target_modules: tuple[str, ...] | list[str], config) -> list[str]:
    """adapted_modules for the model of `config` (built on the meta device when needed), as the last
    names of modules: what an engine's LoRA layers wrap (vLLM's `lora_target_modules`). An engine
    restricted to them wraps nothing the adapter leaves alone: a mixture of experts' fused experts stay
    vLLM's plain fused-MoE layer, without LoRA kernels in its forward (vLLM 0.26 also cannot reload
    the weights of a fused-MoE layer it wrapped: its expert mapping looks for them under `base_layer.`)."""
    if peft_targets(target_modules) == ALL_LINEAR:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return adapted_modules(target_modules, AutoModelForCausalLM.from_config(config))
    return sorted({t.rsplit(".", 1)[-1] for t in target_modules})


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """The names, relative to a decoder layer, of its linear layers (`self_attn.q_proj`, ...):
    what "all-linear" adapts and what model.lora_target_modules may name."""
    from spmd_rl.model.fused_kernels import decoder_layers

    layer = decoder_layers(model)[0]
    return [name for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
