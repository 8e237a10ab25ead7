"""Stream the FSDP2 actor's weights, unsharded, into a rollout engine.

The actor's parameters are DTensors sharded on dim 0 (FSDP2 `fully_shard`) along one mesh
dimension: the whole mesh, or under hybrid sharding the shard group, each replica holding
a full copy. We walk them in order and gather them a *bucket* at a time: each rank casts its
local shards to the engine's dtype (halving the bytes moved for fp32 masters), packs them into
one flat buffer, and a single all-gather into one tensor per bucket over the shard group brings
every rank the full tensors (under HSDP with a node per shard group, nothing crosses nodes). The bucket's
tensors are handed to the engine, and the next bucket reuses nothing from it, so the extra
memory peaks at about two buckets -- never a whole state dict, never a CPU copy.

Tied parameters (Qwen2.5-0.5B's embedding / lm_head) appear once in `named_parameters()`, under
the embedding's name; engines tie lm_head to it themselves.

A LoRA actor (spmd_rl.model.lora) is synced one of two ways (model.lora_sync). Adapter sync: the
base once (`iter_base_weights`, transformers names, never merged), then each step the adapter alone
(`gather_adapter`, PEFT's saved names, float32). Merged sync: each adapted layer's base weight (gathered in
its own dtype, losslessly) and its adapter (gathered in float32) travel in one bucket, and the
engine gets W + (alpha / r) * B @ A computed in float32, then cast, under the transformers name
(`q_proj.weight`, not `q_proj.base_layer.weight`).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Callable, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor, Shard

from spmd_rl.model import lora
from spmd_rl.runtime.distributed import all_gather_flat

NamedTensors = list[tuple[str, torch.Tensor]]


def _shard_mesh_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension over which `p` is split on its dim 0, if it is split over exactly one of
    more than one rank and replicated over any other (FSDP2's 1-D and hybrid 2-D layouts); else
    None (left to DTensor's full_tensor)."""
    if not isinstance(p, DTensor):
        return None
    split = [i for i, pl in enumerate(p.placements) if pl == Shard(0)]
    others = [pl for i, pl in enumerate(p.placements) if i not in split]
    if len(split) != 1 or not all(pl.is_replicate() for pl in others) or p.device_mesh.size(split[0]) == 1:
        return None
    return split[0]


def _whole_locally(p: DTensor) -> bool:
    return all(pl.is_replicate() or p.device_mesh.size(i) == 1 for i, pl in enumerate(p.placements))


def _bucket_plan(params: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int,
                 group_of: Callable[[str], str] = lambda name: "") -> list[list[tuple[str, torch.Tensor]]]:
    """`params` (name, parameter) in buckets of about `bucket_bytes`; consecutive parameters of one
    non-empty `group_of` (a LoRA layer's base weight and adapter) stay in one bucket."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, p in params:
        nbytes = p.numel() * dtype.itemsize
        joins = buckets[-1] and group_of(name) and group_of(name) == group_of(buckets[-1][-1][0])
        if buckets[-1] and size + nbytes > bucket_bytes and not joins:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return [b for b in buckets if b]


def _gather_bucket(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> NamedTensors:
    """One collective (over the shard group) for all dim-0-sharded DTensors of the bucket; others
    are passed through."""
    sharded = [(n, p) for n, p in params if _shard_mesh_dim(p) is not None]
    out: dict[str, torch.Tensor] = {}
    if sharded:
        mesh, dim = sharded[0][1].device_mesh, _shard_mesh_dim(sharded[0][1])
        sharded = [(n, p) for n, p in sharded if p.device_mesh == mesh and _shard_mesh_dim(p) == dim]
        group = mesh.get_group(dim)
        world = mesh.size(dim)
        device = sharded[0][1].to_local().device
        # Per parameter: ceil(dim0 / world) rows per rank (torch.chunk's split, as FSDP2 uses).
        layout = []
        total = 0
        for name, p in sharded:
            rows = math.ceil(p.shape[0] / world)
            row_numel = math.prod(p.shape[1:])
            layout.append((name, p, rows, row_numel, total))
            total += rows * row_numel
        send = torch.zeros(total, dtype=dtype, device=device)
        for name, p, rows, row_numel, off in layout:
            local = p.to_local()
            send[off : off + local.numel()].copy_(local.reshape(-1))
        recv = torch.empty(world * total, dtype=dtype, device=device)
        all_gather_flat(recv, send, group=group)
        recv = recv.view(world, total)
        for name, p, rows, row_numel, off in layout:
            full = recv[:, off : off + rows * row_numel].reshape(world * rows, *p.shape[1:])
            out[name] = full[: p.shape[0]]
    for name, p in params:
        if name not in out:
            if isinstance(p, DTensor):  # split only over 1-rank dims (a 1-rank shard group): whole locally
                t = p.to_local() if _whole_locally(p) else p.full_tensor()
            else:
                t = p.detach()
            out[name] = t.to(dtype)
    return [(name, out[name]) for name, _ in params]


def checkpoint_buffers(model: torch.nn.Module) -> NamedTensors:
    """The model's buffers that its checkpoint holds (persistent ones: a DeepSeek-V3-style router's
    `e_score_correction_bias`), whole on every rank (FSDP shards parameters only), in their own dtype:
    an engine loads them with the weights, and a bias that steers the experts' choice is not rounded."""
    return [(f"{prefix}.{name}" if prefix else name, b) for prefix, module in model.named_modules()
            for name, b in module.named_buffers(recurse=False)
            if b is not None and name not in module._non_persistent_buffers_set]


@torch.no_grad()
def iter_weight_buckets(model: torch.nn.Module, dtype: torch.dtype, bucket_mb: int) -> Iterator[NamedTensors]:
    """Yield the model's parameters as full tensors of `dtype`, one bucket (list of (name, tensor))
    at a time; a LoRA actor's merged (module doc); then its checkpoint_buffers, if any, as they are.
    Collective: every rank of the FSDP mesh must iterate it to the end (under hybrid sharding, every
    rank of each shard group)."""
    if not lora.has_adapter(model):
        for bucket in _bucket_plan(model.named_parameters(), dtype, bucket_mb * 2**20):
            yield _gather_bucket(bucket, dtype)
    else:
        scale = lora.scalings(model)
        for bucket in _bucket_plan(model.named_parameters(), dtype, bucket_mb * 2**20, lora.group_of):
            yield lora.merge(_gather_by_dtype(bucket, functools.partial(_merge_input_dtype, dtype)), scale, dtype)
    buffers = checkpoint_buffers(model)
    if buffers:
        yield [(lora.base_name(name), b) for name, b in buffers]


def _merge_input_dtype(engine_dtype: torch.dtype, name: str, p: torch.Tensor) -> torch.dtype:
    """The dtype a LoRA actor's parameter is gathered in: the adapter float32, the adapted base
    weights their own (lossless: the merge is computed from them), the rest the engine's."""
    if lora.is_adapter(name):
        return torch.float32
    return p.dtype if lora.BASE_LAYER in name else engine_dtype


def _gather_by_dtype(params: list[tuple[str, torch.Tensor]],
                     dtype_of: Callable[[str, torch.Tensor], torch.dtype]) -> NamedTensors:
    """_gather_bucket per gather dtype (one collective each), in the bucket's order."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, p in params:
        groups[dtype_of(name, p)].append((name, p))
    out = dict(kv for dtype, group in groups.items() for kv in _gather_bucket(group, dtype))
    return [(name, out[name]) for name, _ in params]


@torch.no_grad()
def iter_base_weights(model: torch.nn.Module, dtype: torch.dtype, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA actor's frozen base alone, as full tensors of `dtype` under transformers' names
    (`q_proj.weight`), and its checkpoint_buffers: what an engine with LoRA layers keeps, while the
    adapter comes apart. Collective like iter_weight_buckets."""
    base = [(name, p) for name, p in model.named_parameters() if not lora.is_adapter(name)]
    for bucket in _bucket_plan(base, dtype, bucket_mb * 2**20):
        for name, t in _gather_bucket(bucket, dtype):
            yield lora.base_name(name), t
    for name, b in checkpoint_buffers(model):
        yield lora.base_name(name), b


@torch.no_grad()
def gather_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA actor's adapter, full tensors in float32 (its master dtype: the engine rounds once, to its
    own adapter dtype), under PEFT's saved names (`base_model.model.<module>.lora_A.weight`). One
    collective over the shard group (the adapter is ~1% of the model). Collective: every rank of the
    FSDP mesh calls it."""
    params = [(name, p) for name, p in model.named_parameters() if lora.is_adapter(name)]
    return {lora.peft_tensor_name(name): t for name, t in _gather_by_dtype(params, lambda n, p: torch.float32)}


def iter_weights(model: torch.nn.Module, dtype: torch.dtype, bucket_mb: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Like iter_weight_buckets, one (name, tensor) at a time (what `load_weights` takes)."""
    for bucket in iter_weight_buckets(model, dtype, bucket_mb):
        yield from bucket
