"""A mixture of experts' weights in its checkpoint's layout: one tensor per expert.

transformers 5 holds a layer's experts fused, one tensor for all of them: `mlp.experts.gate_up_proj`
[experts, 2 x intermediate, hidden] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` [experts, hidden, intermediate]. The models' checkpoints, and the loaders
written for them, list each expert: `mlp.experts.{e}.gate_proj.weight` and `up_proj.weight`
[intermediate, hidden], `down_proj.weight` [hidden, intermediate]. That is what transformers'
`save_pretrained` writes (its checkpoint conversion reversed); `per_expert` gives the same names and
values as views of the fused tensors (nothing is copied), one tensor at a time, so a weight stream
stays a stream.

Who reads which layout: the trainer and the HF engine the fused one, and the vLLM engine too (each
fused-MoE layer's own loader takes it: spmd_rl.rollout.vllm.engine.load_fused_experts); export writes
the per-expert one, as `save_pretrained` does, for the loaders written for the checkpoints.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

FUSED_EXPERTS = re.compile(r"^(?P<experts>(?:.*\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")
"""A fused expert tensor's name (transformers 5's `...mlp.experts.gate_up_proj` / `down_proj`)."""

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
