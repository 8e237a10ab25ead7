"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint (DCP), plus
each rank's small training state (step, data position, schedulers, RNG) as a torch file.

Layout under <run_dir>/checkpoints:

    step_12/                 a complete checkpoint (DCP files + trainer_state_rank{r}.pt)
    step_12.tmp/             a save in progress; never read, removed by the next save
    latest                   text: the name of the newest complete checkpoint

A save writes `step_N.tmp`, waits for every rank, renames it to `step_N` and only then points
`latest` at it (write + os.replace), so a crash at any moment leaves `latest` on a complete
checkpoint. Older checkpoints beyond `keep_last` are deleted after that.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class ModelAndOptimizer(Stateful):
    """DCP view of one FSDP model and its optimizer (sharded, resharding-safe)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    def __init__(self, root: str, keep_last: int):
        self.root, self.keep_last = root, keep_last

    def complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for d in os.listdir(self.root) if (m := _STEP_DIR.match(d)))

    def latest(self) -> str | None:
        """The newest complete checkpoint, or None."""
        pointer = os.path.join(self.root, "latest")
        if os.path.isfile(pointer):
            with open(pointer) as f:
                name = f.read().strip()
            path = os.path.join(self.root, name)
            if os.path.isdir(path):
                return path
            log.warning("checkpoints/latest names %r, which is missing; using the newest step_N directory", name)
        steps = self.complete_steps()
        return os.path.join(self.root, f"step_{steps[-1]}") if steps else None

    def save(self, step: int, models: dict[str, Stateful], trainer_state: dict[str, Any]) -> str:
        final = os.path.join(self.root, f"step_{step}")
        tmp = final + ".tmp"
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            for d in os.listdir(self.root):  # leftovers of interrupted saves
                if d.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
        _barrier()
        dcp.save(dict(models), checkpoint_id=tmp)
        torch.save(trainer_state, os.path.join(tmp, f"trainer_state_rank{_rank()}.pt"))
        _barrier()
        if _rank() == 0:
            if os.path.isdir(final):  # re-saving the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            with open(os.path.join(self.root, "latest.tmp"), "w") as f:
                f.write(f"step_{step}\n")
            os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
            for old in self.complete_steps()[:-self.keep_last]:
                shutil.rmtree(os.path.join(self.root, f"step_{old}"), ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str, models: dict[str, Stateful]) -> dict[str, Any]:
        """Restore models/optimizers in place; returns this rank's trainer state."""
        state_file = os.path.join(path, f"trainer_state_rank{_rank()}.pt")
        if not os.path.isfile(state_file):
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise RuntimeError(
                f"checkpoint {path} has no {os.path.basename(state_file)}: it was written by a run with a "
                f"different number of ranks (this run has {world}) or is incomplete; resume with the same "
                "world size, or start a new run_dir")
        dcp.load(dict(models), checkpoint_id=path)
        return torch.load(state_file, weights_only=False)
