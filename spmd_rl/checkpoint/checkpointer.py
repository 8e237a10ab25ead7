"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint (DCP), plus
each rank's small training state (step, data position, schedulers, RNG) as a torch file.

Layout under the checkpoint directory (trainer.checkpoint_dir, by default <run_dir>/checkpoints):

    step_12/                 a complete checkpoint: DCP files, trainer_state_rank{r}.pt, manifest.json
    step_12.tmp/             a save in progress (or abandoned by a crash); never read, removed by the next save
    latest                   text: the name of the newest complete checkpoint

`Checkpointer` composes the two sides: the write side (spmd_rl/checkpoint/saving.py: a save,
synchronous or asynchronous, its commit, the disk space it needs, failed writes, `keep_last`) and
the read side (spmd_rl/checkpoint/reading.py: finding, verifying and loading checkpoints, the
checkpoint to resume from). Their names are importable from here.

The trainer's last save (end of training, or a stop signal) follows the write side's rules; when
it is not written the run exits with EXIT_NOT_SAVED (4), never 0 or the requeue status 3
(spmd_rl/trainer.py Trainer.fit).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from spmd_rl.checkpoint import reading
from spmd_rl.checkpoint.reading import MANIFEST, CheckpointError, read_manifest, run_dir_of, saved_world_size, verify
from spmd_rl.checkpoint.saving import FAULT_ENV, WRITE_THREADS, CheckpointSaver

__all__ = ["EXIT_NOT_SAVED", "FAULT_ENV", "MANIFEST", "WRITE_THREADS", "CheckpointError", "Checkpointer",
           "CheckpointSaver", "ModelAndOptimizer", "read_manifest", "run_dir_of", "saved_world_size", "verify"]

EXIT_NOT_SAVED = 4
"""Exit status of a run whose last checkpoint (at the end of training, or on a stop signal) was not
written: skipped for lack of disk space, or its write failed. The log names why and the latest
complete checkpoint; a requeue would only repeat it, so this is not EXIT_PREEMPTED."""


class ModelAndOptimizer(Stateful):
    """DCP view of one FSDP model and its optimizer (sharded, resharding-safe). `trainable_only`: the
    model's frozen parameters are left out (a LoRA actor: the adapter is saved, the base is read
    from the model directory again on resume)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False):
        self.model, self.optimizer = model, optimizer
        self.trainable_only = trainable_only
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": self._model_state()}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": self._kept(model_sd), "optim": optim_sd}

    def _model_state(self) -> dict[str, Any]:
        return self._kept(get_state_dict(self.model, [], options=self.options)[0])

    def _kept(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        """With trainable_only, the trainable parameters alone: ignore_frozen_params keeps the second
        name of a tied frozen parameter (a tied `lm_head.weight`: a vocabulary-sized tensor)."""
        if not self.trainable_only:
            return model_sd
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model_sd.items() if k in trainable}

    def planned_state(self) -> dict[str, Any]:
        """What state_dict() holds, to measure it (space.measure), without creating the
        optimizer's state: AdamW has none before its first step, and get_state_dict would create it
        by stepping the optimizer once (its step count would then be one ahead). What AdamW will
        hold stands in for it: per parameter two moments of its shape, dtype and sharding (three
        with amsgrad; the parameter itself stands in, nothing is allocated) and a step count."""
        if self.optimizer is None or self.optimizer.state:
            return self.state_dict()
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"planned_state knows the state of Adam and AdamW, not {type(self.optimizer).__name__}")
        names = {id(p): n for n, p in self.model.named_parameters()}
        state, groups = {}, []
        for group in self.optimizer.param_groups:
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            for p in group["params"]:
                state[names[id(p)]] = {**dict.fromkeys(moments, p), "step": torch.zeros(())}
            groups.append({**group, "params": [names[id(p)] for p in group["params"]]})
        return {"model": self._model_state(), "optim": {"state": state, "param_groups": groups}}

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every model tensor, by its key under "model"."""
        return {k: tuple(v.shape) for k, v in self._model_state().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # not strict with trainable_only: the frozen keys are missing by design (DCP's load still
        # refuses a checkpoint that lacks a key the model asks for)
        set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=self.options)


class Checkpointer:
    """Saves and finds checkpoints under `root`. Build it on every rank (collectively: it creates a
    gloo process group of its own) and `close()` it before the process group is destroyed.
    `run_dir`: recorded in each checkpoint's manifest (the export and the resume check find the
    run's config.toml there when `root` is elsewhere)."""

    def __init__(self, root: str, keep_last: int, async_save: bool = False, run_dir: str = ""):
        self.root = root
        # The checkpointer's collectives (decisions, agreement on failures, DCP's own) run on a gloo
        # group of its own: CPU tensors, and background collectives must not share a group with the
        # training loop's (ops issued from two threads on one group can interleave differently per rank).
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        run_dir = os.path.abspath(run_dir or os.path.dirname(os.path.abspath(root)))
        self.saver = CheckpointSaver(root, keep_last, async_save, run_dir, self._group)

    @property
    def keep_last(self) -> int:
        return self.saver.keep_last

    @property
    def async_save(self) -> bool:
        return self.saver.async_save

    @property
    def run_dir(self) -> str:
        return self.saver.run_dir

    @property
    def stall_parts(self) -> dict[str, float]:
        """Seconds of the last save's parts that training waited for."""
        return self.saver.stall_parts

    # ------------------------------------------------------------------ the read side (reading.py)
    def complete_steps(self) -> list[int]:
        return reading.complete_steps(self.root)

    def latest(self) -> str | None:
        """The newest committed checkpoint, or None. Not verified: see find_resume."""
        return reading.latest(self.root)

    def has_checkpoints(self) -> bool:
        return reading.has_checkpoints(self.root)

    def find_resume(self, resume: str) -> str | None:
        """The verified checkpoint to resume from for trainer.resume = `resume` (reading.find_resume);
        None = start fresh. Collective."""
        return reading.find_resume(self.root, resume, self._group)

    def load(self, path: str, models: dict[str, Stateful]) -> dict[str, Any]:
        """Restore models/optimizers in place from `path`; returns this rank's trainer state (reading.load)."""
        return reading.load(path, models)

    # ------------------------------------------------------------------ the write side (saving.py)
    def log_space_plan(self, models: dict[str, ModelAndOptimizer], trainer_state: dict[str, Any]) -> None:
        """The start-up line of the disk space a save needs (CheckpointSaver.log_space_plan). Collective."""
        self.saver.log_space_plan({n: m.planned_state() for n, m in models.items()}, trainer_state)

    def save(self, step: int, models: dict[str, Stateful], trainer_state: dict[str, Any]) -> str | None:
        """Checkpoint step `step` as `<root>/step_<step>` (CheckpointSaver.save); None when it is not
        written. Collective."""
        return self.saver.save(step, models, trainer_state)

    def in_flight(self) -> bool:
        """Whether this rank's part of the last asynchronous save is still running."""
        return self.saver.in_flight()

    def wait(self) -> bool:
        """Wait for the save in flight, if any (CheckpointSaver.wait)."""
        return self.saver.wait()

    def close(self) -> None:
        """Wait for the save in flight, stop the writer thread, free the staging buffers. Idempotent."""
        self.saver.close()
