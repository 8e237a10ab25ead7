"""Disk space of checkpoints: the bytes a save writes, the free space where it goes, which older
checkpoints a save may remove first, and the start-up line that says whether it all fits.

Bytes of a save (`measure`), from the state dict DCP is given, not from an earlier save's files:
- every tensor's local part (FSDP's DTensor shards, the optimizer's moments, plain tensors) plus
  the records torch.save wraps it in (DCP writes each tensor as one torch.save archive: measured
  once, on an empty tensor), divided by the ranks that hold the same part (DCP writes a replicated
  part once: HSDP's replicas; plain tensors and Python values, held by every rank);
- every other value (the optimizer's param_groups) as torch.save writes it;
- each rank's trainer state (trainer_state_rank{r}.pt) as torch.save writes it;
- DCP's .metadata, about METADATA_BYTES_PER_ITEM per item written.
That is within a few percent of the files once a model has a few hundred kB
(tests/checkpoint/test_checkpoint_space.py checks 5% on 1 rank and on 2 FSDP ranks).

At start-up on a fresh run the optimizer has no state yet (AdamW creates it at its first step), and
DCP's get_state_dict would create it by stepping the optimizer once (its step count would then be
one ahead). The start-up figure counts what AdamW will hold instead: two moments of each
parameter's shape, dtype and sharding (three with amsgrad) and a step count
(`ModelAndOptimizer.planned_state`). Every save measures its own state dict.

The peak on disk: a checkpoint is removed only once a newer one is complete, so a save needs room
for `keep_last` checkpoints plus the one being written (+ HEADROOM). When a save finds less free
space than its bytes + HEADROOM, it first removes the checkpoints it would remove anyway once
complete -- all but the newest max(keep_last - 1, 1), never the latest complete one (`removable`)
-- oldest first, as many as it needs; the lowest peak is then max(keep_last - 1, 1) checkpoints +
the one being written. When even that is not enough, the save is skipped with one warning line.

The checkpoint directory must be one filesystem that every rank sees (on several nodes a shared
one): rank 0 measures its free space and decides for every rank, as rank 0 already verifies every
rank's files before a checkpoint becomes the latest, and a resume on another layout reads other
ranks' files.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

HEADROOM = 0.05
"""A save starts only when the free space is at least its estimated bytes times 1 + HEADROOM: the
estimate is within a few percent, and the filesystem needs some room of its own."""

METADATA_BYTES_PER_ITEM = 300
"""Bytes of DCP's .metadata per item written (a tensor part or a value): its index, offsets,
sizes, file and byte range. Measured: 287 on the tiny-cpu preset's 197 items, 219 on a toy model's
28; 1.5B: ~1,000 items, 0.3 MB of 19 GB."""


class CheckpointSize(NamedTuple):
    total: int  # bytes of one checkpoint, all ranks together
    per_rank: int  # the most any rank writes
    ranks: int


# --------------------------------------------------------------------------- bytes of a save


@functools.cache
def _record_bytes() -> int:
    """What torch.save adds around a tensor's data (its zip archive's records)."""
    return _saved_bytes(torch.empty(0))


def _saved_bytes(value: Any) -> int:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.tell()


def _world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _holders(t: torch.Tensor, world: int) -> int:
    """Ranks that hold this rank's part of `t` (DCP writes it once, on one of them)."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
    return world


def _leaves(state: Any) -> Iterator[Any]:
    """The values DCP writes one by one, as its flattening finds them: mappings and lists holding
    tensors or containers are opened, anything else is one value."""
    if isinstance(state, Mapping):
        for v in state.values():
            yield from _leaves(v)
    elif isinstance(state, list) and any(isinstance(v, (Mapping, list, torch.Tensor)) for v in state):
        for v in state:
            yield from _leaves(v)
    else:
        yield state


def rank_bytes(state: Any, world: int) -> float:
    """This rank's share of what DCP writes for `state` (a nested state dict), .metadata included."""
    share = 0.0
    for v in _leaves(state):
        if isinstance(v, torch.Tensor):
            local = v.to_local() if isinstance(v, DTensor) else v
            data = local.numel() * local.element_size() + _record_bytes()
            share += (data + METADATA_BYTES_PER_ITEM) / _holders(v, world)
        else:
            share += (_saved_bytes(v) + METADATA_BYTES_PER_ITEM) / world
    return share


def measure(state: Any, trainer_state: Any, group=None) -> CheckpointSize:
    """Bytes of a checkpoint of `state` (what DCP is given) and this rank's `trainer_state`, on
    every rank. Collective over `group` when torch.distributed is initialized."""
    world = _world(group)
    mine = torch.tensor([rank_bytes(state, world) + _saved_bytes(trainer_state)], dtype=torch.float64)
    if world == 1:
        shares = [mine]
    else:
        shares = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(shares, mine, group=group)
    values = [float(s.item()) for s in shares]
    return CheckpointSize(round(sum(values)), round(max(values)), world)


# --------------------------------------------------------------------------- room on disk


def free_space(path: str) -> tuple[int, str]:
    """Bytes that can still be written on the filesystem of `path` (its nearest existing parent;
    what an unprivileged user may use), and that filesystem's mount point."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    mount = p
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return shutil.disk_usage(p).free, mount


def dir_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 if it does not exist)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, n))
            except OSError:  # removed meanwhile
                pass
    return total


def needed(size: CheckpointSize) -> int:
    """Free bytes a save must find before it starts."""
    return math.ceil(size.total * (1 + HEADROOM))


def removable(steps: list[int], latest: int | None, step: int, keep_last: int) -> list[int]:
    """The complete checkpoints (their steps) a save of `step` may remove before writing, oldest
    first: those it would remove anyway once complete -- all older ones but the newest
    max(keep_last - 1, 1) -- and never `latest`, the latest complete one."""
    older = [s for s in steps if s < step]
    keep = max(keep_last - 1, 1)
    return [s for s in older[:-keep] if s != latest]


def where(mount: str, root: str) -> str:
    """`mount (root)`: the filesystem, and the checkpoint directory on it."""
    return mount if os.path.abspath(root) == mount else f"{mount} ({root})"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def plan_line(size: CheckpointSize, keep_last: int, free: int, held: int, root: str, mount: str) -> tuple[int, str]:
    """The start-up line (a logging level and the text): the bytes of a save, keep_last, the peak
    a save needs on disk, the free space where checkpoints go (`held`: bytes of the checkpoints
    already there, which count as room: they are removed as newer ones come); when it does not
    fit, a warning with the fix."""
    one = needed(size)  # the new checkpoint, while the kept ones are on disk
    peak, lowest = keep_last * size.total + one, max(keep_last - 1, 1) * size.total + one
    room = free + held
    line = (f"checkpoints: {gb(size.total)} a save ({gb(size.per_rank)} per rank x {size.ranks}), keep_last "
            f"{keep_last}: {gb(peak)} on disk at the peak of a save ({keep_last} kept + 1 being written with "
            f"{HEADROOM:.0%} headroom" + (f"; {gb(lowest)} if the older ones it replaces are removed first"
                                          if lowest < peak else "") + f"); {gb(free)} free "
            f"on {where(mount, root)}" + (f", and {gb(held)} of checkpoints there" if held else ""))
    if room >= peak:
        return logging.INFO, line
    if room >= lowest:
        return logging.INFO, line + ": fits, by removing the oldest checkpoint before a save"
    fits = [k for k in range(1, keep_last) if max(k - 1, 1) * size.total + one <= room]
    fix = (f"trainer.checkpoint_dir on a filesystem with {gb(peak)} free"
           + (f", or trainer.keep_last = {fits[-1]}" if fits else "")
           + ", or trainer.save_every = -1 (no checkpoints)")
    what = "saves will be skipped" if room >= one else "not even one save fits"
    return logging.WARNING, (f"{line}: DOES NOT FIT, {what} (a warning line each; training goes on, and the run "
                             f"exits with status 4 if its last checkpoint is not written). Fix: {fix}")
