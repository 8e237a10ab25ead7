"""The read side of checkpoints: finding them under a checkpoint directory (the complete steps,
the `latest` pointer, the checkpoint to resume from), verifying one before it is trusted, and
loading one into the models (spmd_rl/checkpoint/checkpointer.py has the directory's layout).

Resuming (`find_resume`) verifies a checkpoint before trusting it -- `manifest.json` sizes, every
byte range DCP's `.metadata` references and every item it lists, a trainer state per rank -- and
falls back to the newest complete one with a warning naming the broken one. Checkpoints that exist
but are all broken are an error (CheckpointError, one line), never a silent restart from step 0.
"""

from __future__ import annotations

import collections
import logging
import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from spmd_rl.checkpoint import manifest as manifest_format

log = logging.getLogger("spmd_rl.checkpoint.checkpointer")  # the read and the write side log as the checkpointer

STEP_DIR = re.compile(r"^step_(\d+)$")
"""The name of a complete checkpoint's directory: step_N."""
MANIFEST = manifest_format.MANIFEST


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or trusted; the message names it and the fix."""


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current_world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# --------------------------------------------------------------------------- finding checkpoints


def complete_steps(root: str) -> list[int]:
    """The steps of the complete checkpoints (step_N directories) under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := STEP_DIR.match(d)))


def pointer(root: str) -> str | None:
    """The name `root`/latest points at, or None."""
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def latest(root: str) -> str | None:
    """The newest committed checkpoint (by the `latest` pointer, else the newest step_N), or
    None. Not verified: see find_resume."""
    name = pointer(root)
    if name and os.path.isdir(os.path.join(root, name)):
        return os.path.join(root, name)
    steps = complete_steps(root)
    return os.path.join(root, f"step_{steps[-1]}") if steps else None


def has_checkpoints(root: str) -> bool:
    return pointer(root) is not None or bool(complete_steps(root))


def find_resume(root: str, resume: str, group: dist.ProcessGroup | None = None) -> str | None:
    """The checkpoint to resume from for trainer.resume = `resume` ("auto", "none" or a path),
    verified; None = start fresh. Rank 0 decides (and warns), every rank gets its answer."""
    if resume == "none":
        return None
    answer: list[Any] = [None]
    if current_rank() == 0:
        try:
            answer[0] = ("ok", _choose(root, resume))
        except CheckpointError as e:
            answer[0] = ("error", str(e))
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0, group=group)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _choose(root: str, resume: str) -> str | None:
    if resume != "auto":
        problem = verify(resume, current_world())
        if problem:
            raise CheckpointError(f"trainer.resume = {resume!r} is not a complete checkpoint: {problem}. "
                                  "Pass a complete step_N directory, or trainer.resume=auto")
        return resume
    name = pointer(root)
    newest = int(name.split("_")[1]) if name and STEP_DIR.match(name) else None
    # The `latest` pointer is the head of the run's timeline: step dirs past it are from a
    # timeline abandoned by an explicit resume, so candidates are the pointer's and older ones.
    steps = [s for s in reversed(complete_steps(root)) if newest is None or s <= newest]
    if newest is not None and newest not in steps:
        log.warning("checkpoints/latest names %s, which is missing; using the newest older one", name)
    broken = []
    for s in steps:
        path = os.path.join(root, f"step_{s}")
        problem = verify(path, current_world())
        if problem is None:
            if broken:
                log.warning("checkpoint %s is broken (%s): resuming from %s instead", broken[0][0],
                            broken[0][1], path)
            return path
        broken.append((path, problem))
        log.warning("checkpoint %s is broken: %s", path, problem)
    if broken or newest is not None:
        raise CheckpointError(
            f"{root} holds checkpoints but none is complete ({len(broken)} broken, e.g. "
            f"{broken[0][0] if broken else name}: {broken[0][1] if broken else 'missing'}): move that "
            "directory away to start fresh, or pass a good checkpoint as trainer.resume")
    if os.path.isdir(root) and any(d.endswith(".tmp") for d in os.listdir(root)):
        log.warning("%s holds only unfinished saves (*.tmp): starting from step 0", root)
    return None


# --------------------------------------------------------------------------- verification


def verify(path: str, world_size: int | None = None) -> str | None:
    """None if `path` is a complete checkpoint, else what is wrong with it (one phrase).

    Checks what a crash, a full disk or a truncated copy breaks: `manifest.json`'s files and
    sizes (written at save time; checkpoints of older versions have none), DCP's `.metadata`
    readable and every byte range it references present, one trainer state per rank."""
    if not os.path.isdir(path):
        return "it is missing"
    manifest: dict[str, Any] = {}
    if os.path.isfile(os.path.join(path, MANIFEST)):
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError) as e:
            return f"{MANIFEST} is unreadable ({e})"
        for name, size in manifest["files"].items():
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                return f"{name} is missing"
            if os.path.getsize(full) != size:
                return f"{name} has {os.path.getsize(full)} bytes, {size} were written"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a missing or truncated .metadata raises anything from OSError to pickle errors
        return f"its DCP .metadata is unreadable ({type(e).__name__})"
    missing = _items_without_data(metadata)
    if missing:
        return f"its DCP .metadata lists {missing} items without data (a writer failed)"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) < end:
            return f"{name} is truncated ({os.path.getsize(full)} of at least {end} bytes)"
    ranks = manifest.get("world_size") or world_size
    for r in range(ranks or 1):
        if not os.path.isfile(os.path.join(path, f"trainer_state_rank{r}.pt")):
            return f"trainer_state_rank{r}.pt is missing"
    return None


def _items_without_data(metadata) -> int:
    """Items (tensor parts, values) DCP's .metadata lists without a byte range: what a writer
    thread that died leaves (DCP does not notice; spmd_rl/checkpoint/writes.py)."""
    have = collections.Counter(index.fqn for index in metadata.storage_data)
    expected = {fqn: len(md.chunks) if hasattr(md, "chunks") else 1 for fqn, md in metadata.state_dict_metadata.items()}
    return sum(max(0, n - have.get(fqn, 0)) for fqn, n in expected.items())


# --------------------------------------------------------------------------- loading


def load(path: str, models: dict[str, Stateful]) -> dict[str, Any]:
    """Restore models/optimizers in place; returns this rank's trainer state. DCP reads only
    each rank's own shards, straight into the FSDP parameters and optimizer states, resharding
    them when the world size changed (saved_world_size). Then every rank takes rank 0's trainer
    state: all of it but the RNG states is the same on every rank, and the RNG states of
    another layout's ranks mean nothing here."""
    saved_world = saved_world_size(path)
    own = current_rank() if saved_world == current_world() else 0
    state_file = os.path.join(path, f"trainer_state_rank{own}.pt")
    if not os.path.isfile(state_file):  # verify() found it: only a file removed since gets here
        raise CheckpointError(f"checkpoint {path} has no {os.path.basename(state_file)}: it is incomplete; "
                              "pass a complete step_N directory as trainer.resume")
    problem = _other_model(path, models)
    if problem:  # checked on every rank alike: DCP's own error is a traceback per rank
        raise CheckpointError(f"checkpoint {path} holds another model: {problem}; resume it with the model "
                              "settings it was trained with (model.path / model.arch, algorithm.adv_estimator), "
                              "or start a new trainer.run_dir")
    dcp.load(dict(models), checkpoint_id=path)
    return torch.load(state_file, weights_only=False)


def _other_model(path: str, models: dict[str, Stateful]) -> str | None:
    """What in `models` the checkpoint `path` does not hold in the same shape (a phrase), or None.
    The config check at resume cannot tell when the checkpoint's run directory has no config.toml
    (a checkpoint copied elsewhere)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, stateful in models.items():
        if not any(k.startswith(f"{name}.") for k in saved):
            return f"it holds no {name}"
        for key, shape in stateful.model_shapes().items():
            fqn = f"{name}.model.{key}"
            if fqn not in saved:
                return f"it has no {fqn}"
            there = tuple(getattr(saved[fqn], "size", shape))
            if there != shape:
                return f"{fqn} has shape {list(there)} there, {list(shape)} in this run's model"
    return None


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint `path` at today's format (manifest_format.read: a checkpoint of an
    older format upgraded, one without a manifest described by its directory). A checkpoint of a
    newer format: CheckpointError, one line naming both versions."""
    try:
        return manifest_format.read(path)
    except manifest_format.NewerFormat as e:
        raise CheckpointError(str(e)) from None


def saved_world_size(path: str) -> int:
    """Ranks of the run that wrote the checkpoint `path`."""
    return int(read_manifest(path)["world_size"])


def run_dir_of(checkpoint: str) -> str:
    """The run directory of the run that wrote `checkpoint` (its config.toml is there)."""
    return str(read_manifest(checkpoint)["run_dir"])
