"""Process-group setup from torchrun's environment, seeding and rank-aware logging."""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spmd_rl.errors import UserError
from spmd_rl.runtime.sp_groups import SPGroups, make_groups


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh
    """The FSDP mesh over all ranks (fsdp_mesh): 1-D ("fsdp",) when every parameter is sharded over
    all ranks; 2-D ("replicate", "shard") for hybrid sharding (trainer.fsdp_size). Data parallelism
    is over all ranks either way (each rank holds its own rows), unless `sp` groups them."""
    sp: SPGroups = field(default_factory=SPGroups)
    """Sequence parallelism (trainer.ulysses_size; spmd_rl.batching.sequence_parallel): the ranks of an SP
    group share their rows and each takes a slice of every packed micro-batch."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (world / ulysses_size): the update's batch sizes are per data-parallel rank."""
        return self.world_size // self.sp.size


def free_port() -> int:
    """A TCP port free on this host right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "auto", fsdp_size: int = 0, ulysses_size: int = 1) -> DistEnv:
    """Join the process group torchrun (or the SLURM launcher) described in the environment, and
    build the FSDP mesh for `fsdp_size` ranks per shard group (fsdp_mesh; 0 = all ranks) and the
    sequence-parallel groups of `ulysses_size` ranks (sp_groups.make_groups).

    A plain `python -m spmd_rl.ppo` run becomes a world of one, so FSDP2 and vLLM's
    external_launcher, which both need a process group, work the same way there."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("trainer.device = 'cuda' but no CUDA GPU is visible: use trainer.device=cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistEnv(rank, world, local_rank, local_world, dev, fsdp_mesh(dev.type, world, fsdp_size),
                   make_groups(ulysses_size))


def fsdp_mesh_shape(world: int, fsdp_size: int) -> tuple[int, ...]:
    """(world,): shard over all ranks (fsdp_size 0 or the world); else (world // fsdp_size,
    fsdp_size): replicas x ranks per shard group. A shard group is fsdp_size consecutive ranks
    (one node, when fsdp_size is the GPUs per node: torchrun numbers a node's ranks together)."""
    if fsdp_size < 0 or (fsdp_size and world % fsdp_size):  # preflight.validate names the fix for users
        raise ValueError(f"fsdp_size = {fsdp_size} does not divide the world size {world}")
    if fsdp_size in (0, world):
        return (world,)
    return (world // fsdp_size, fsdp_size)


def fsdp_mesh(device_type: str, world: int, fsdp_size: int = 0) -> DeviceMesh:
    """The device mesh FSDP2's fully_shard takes: 1-D ("fsdp",) shards over all ranks; 2-D
    ("replicate", "shard") is hybrid sharding (HSDP): parameters sharded within each group of
    fsdp_size ranks, replicated across the groups. Under HSDP, FSDP2 reduce-scatters gradients in
    the shard group, then all-reduces the shards across the replicas; together they average over
    all ranks, as plain FSDP does (update.global_denominator relies on it; tests/train/test_hsdp.py)."""
    shape = fsdp_mesh_shape(world, fsdp_size)
    names = ("fsdp",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def raise_together(fn=None) -> None:
    """Collective: call `fn` (on the ranks that pass one); if it raises a UserError on any rank,
    raise that message on every rank, so they all stop alike instead of the others hanging in
    their next collective."""
    error = None
    if fn is not None:
        try:
            fn()
        except UserError as e:
            error = str(e)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise UserError(first)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def setup_logging(rank: int, log_file: str | None = None) -> None:
    """Rank 0 logs INFO to the console (and log_file); other ranks only warnings."""
    root = logging.getLogger()
    root.handlers.clear()
    fmt = logging.Formatter(f"%(asctime)s [r{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if log_file and rank == 0:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        root.addHandler(fh)


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Mean over ranks of each scalar (same keys on every rank)."""
    return all_reduce_metrics(values, device)


_OPS = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_metrics(values: dict[str, float], device: torch.device,
                       reduction: Callable[[str], str] = lambda key: "mean") -> dict[str, float]:
    """Each scalar over ranks (same keys on every rank), as `reduction(key)` says: "mean", "max"
    or "min" (one collective per kind used)."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    out = {}
    for how, op in _OPS.items():
        keys = sorted(k for k in values if reduction(k) == how)
        if not keys:
            continue
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        if how == "mean":
            t /= dist.get_world_size()
        out.update(zip(keys, t.tolist()))
    return out


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Every rank's `input` into `output` ([world * input.numel()], rank order): torch's
    `all_gather_single`, or on a torch without it (before 2.13) the same collective under its
    older name `all_gather_into_tensor`, which 2.13 deprecates with a warning at every call site."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def all_reduce_sum(t: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) over the group's ranks, wherever `t` lives: NCCL only reduces CUDA tensors,
    so CPU tensors make the round trip through the current GPU."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    device = t.device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        work = t.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        work = t.clone()
    dist.all_reduce(work, op=op, group=group)
    return work.to(device)


def all_reduce_max_int(value: int) -> int:
    """The largest of every rank's `value` (1 process: the value itself)."""
    return int(all_reduce_sum(torch.tensor([value], dtype=torch.int64), op=dist.ReduceOp.MAX)[0])


def all_gather_union(names: set[str]) -> list[str]:
    """Every rank's `names` together, sorted (1 process: its own): metrics that some ranks lack
    still need a value on every rank for all_reduce_mean."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sorted(names)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return sorted(set().union(*gathered))
