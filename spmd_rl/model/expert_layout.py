"""A mixture of experts' weights in its checkpoint's layout: one tensor per expert.

transformers 5 holds a layer's experts fused, one tensor for all of them: `mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [experts, hidden, intermediate]. The models' checkpoints, and the loaders
written for them, list each expert: `mlp.experts.{e}.gate_proj.weight` and `up_proj.weight`
[intermediate, hidden], `down_proj.weight` [hidden, intermediate]. That is what transformers'
`save_pretrained` writes (its checkpoint conversion reversed); `per_expert` gives the same names and
values as views of the fused tensors (nothing is copied), one tensor at a time, so a weight stream
stays a stream.

Who reads which layout: the trainer and the HF engine the fused one; vLLM's loaders the per-expert one,
except those that take the fused tensors whole (`LOADERS_OF_FUSED_EXPERTS`); export writes the
per-expert one, as `save_pretrained` does.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

FUSED_EXPERTS = re.compile(r"^(?P<experts>(?:.*\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")
"""A fused expert tensor's name (transformers 5's `...mlp.experts.gate_up_proj` / `down_proj`)."""

LOADERS_OF_FUSED_EXPERTS = frozenset({"qwen3_moe"})
"""Model types whose vLLM loader takes transformers' fused expert tensors whole (one copy a tensor
instead of one a tensor and expert): vLLM 0.26's Qwen3-MoE hands `experts.gate_up_proj` to its
fused-MoE layer. Every other family's loader reads the checkpoint's per-expert names (GLM-4.7-Flash's
`glm4_moe_lite` refuses a fused name with a KeyError)."""


def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` in the checkpoint's layout: a fused expert tensor as its experts' tensors
    (views), anything else as it is."""
    match = FUSED_EXPERTS.match(name)
    if match is None or tensor.dim() != 3:
        return [(name, tensor)]
    experts = match["experts"]
    if match["proj"] == "down_proj":
        return [(f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    gate, up = tensor.chunk(2, dim=1)
    return [pair for e in range(tensor.shape[0])
            for pair in ((f"{experts}.{e}.gate_proj.weight", gate[e]), (f"{experts}.{e}.up_proj.weight", up[e]))]


def iter_per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A weight stream in the checkpoint's layout (per_expert on each tensor, lazily)."""
    for name, tensor in weights:
        yield from per_expert(name, tensor)


def vllm_loads_per_expert(config: dict) -> bool:
    """Whether vLLM's loader of a config.json's (text config's) model needs the per-expert layout: a
    mixture of experts whose model type is not in LOADERS_OF_FUSED_EXPERTS."""
    from spmd_rl.runtime.memory_plan import experts_of

    return experts_of(config) > 0 and config.get("model_type") not in LOADERS_OF_FUSED_EXPERTS
