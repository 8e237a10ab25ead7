"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint (DCP), plus
each rank's small training state (step, data position, schedulers, RNG) as a torch file.

Layout under <run_dir>/checkpoints:

    step_12/                 a complete checkpoint: DCP files, trainer_state_rank{r}.pt, manifest.json
    step_12.tmp/             a save in progress (or abandoned by a crash); never read, removed by the next save
    latest                   text: the name of the newest complete checkpoint

A save writes `step_N.tmp`; once every rank's files are written, rank 0 verifies them against
DCP's `.metadata`, writes `manifest.json` (every file and its size), renames the directory to
`step_N` and only then points `latest` at it (write + os.replace). A crash at any moment leaves
`latest` on a complete checkpoint. Older checkpoints beyond `keep_last` are deleted after that.

Asynchronous saves (`trainer.async_save`): the training step only waits while the state is copied
to host memory (`dcp.async_save` with checkpoint_staging.HostStager: host buffers allocated once,
pinned on GPU machines, reused by every save); the files are
written by a background thread while the next steps train, over a gloo process group of the
checkpointer's own (the training collectives keep theirs). At most one save is in flight: the
next save, `wait()` and `close()` wait for it. A save that fails in the background is logged when
it fails, raised on every rank at the next save or `wait()`, and never becomes `latest`.

Resuming (`find_resume`) verifies a checkpoint before trusting it -- `manifest.json` sizes, every
byte range DCP's `.metadata` references, a trainer state per rank -- and falls back to the newest
complete one with a warning naming the broken one. Checkpoints that exist but are all broken are
an error (CheckpointError, one line), never a silent restart from step 0.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from spmd_rl.checkpoint_staging import make_stager

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
WRITE_THREADS = min(8, os.cpu_count() or 1)
"""Threads (and files) per rank that write a checkpoint. DCP's default is one: a rank's shards then
go through one thread's serialisation at about 1.1 GB/s (measured: a 7B actor's 86 GB took 75 s
on 2 ranks into tmpfs), which bounds the save at the end of a run and, when a write outlasts the
steps between saves, the next save's stall."""
FAULT_ENV = "SPMD_RL_CHECKPOINT_FAULT"
"""Test hook, read by the background writer: "fail@N" makes the save of step N fail after its
files are written; "delay@N:S" holds the commit of step N back S seconds (a save in flight)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or trusted; the message names it and the fix."""


class ModelAndOptimizer(Stateful):
    """DCP view of one FSDP model and its optimizer (sharded, resharding-safe)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_state_dict(self.model, [])[0]}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (unsharded) shape of every model tensor, by its key under "model"."""
        return {k: tuple(v.shape) for k, v in get_state_dict(self.model, [])[0].items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# --------------------------------------------------------------------------- verification


def _files(path: str) -> dict[str, int]:
    """Every file under `path` (relative name -> size), the manifest itself excluded."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, path)
            if rel != MANIFEST:
                out[rel] = os.path.getsize(full)
    return out


def verify(path: str, world_size: int | None = None) -> str | None:
    """None if `path` is a complete checkpoint, else what is wrong with it (one phrase).

    Checks what a crash, a full disk or a truncated copy breaks: `manifest.json`'s files and
    sizes (written at save time; checkpoints of older versions have none), DCP's `.metadata`
    readable and every byte range it references present, one trainer state per rank."""
    if not os.path.isdir(path):
        return "it is missing"
    manifest: dict[str, Any] = {}
    mpath = os.path.join(path, MANIFEST)
    if os.path.isfile(mpath):
        try:
            with open(mpath) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            return f"{MANIFEST} is unreadable ({e})"
        for name, size in manifest.get("files", {}).items():
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                return f"{name} is missing"
            if os.path.getsize(full) != size:
                return f"{name} has {os.path.getsize(full)} bytes, {size} were written"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a missing or truncated .metadata raises anything from OSError to pickle errors
        return f"its DCP .metadata is unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) < end:
            return f"{name} is truncated ({os.path.getsize(full)} of at least {end} bytes)"
    ranks = manifest.get("world_size", world_size)
    for r in range(ranks or 1):
        if not os.path.isfile(os.path.join(path, f"trainer_state_rank{r}.pt")):
            return f"trainer_state_rank{r}.pt is missing"
    return None


def _fault(step: int) -> tuple[str, float] | None:
    spec = os.environ.get(FAULT_ENV, "")
    m = re.fullmatch(r"(fail|delay)@(\d+)(?::([\d.]+))?", spec)
    if not m or int(m.group(2)) != step:
        return None
    return m.group(1), float(m.group(3) or 0)


# --------------------------------------------------------------------------- the checkpointer


def _writer(path: str) -> dcp.FileSystemWriter:
    """DCP's file writer with WRITE_THREADS threads, each writing its own file of this rank's shards."""
    return dcp.FileSystemWriter(path, thread_count=WRITE_THREADS)


class Checkpointer:
    """Saves and finds checkpoints under `root`. Build it on every rank (collectively: an
    asynchronous one creates its own gloo process group) and `close()` it before the process
    group is destroyed."""

    def __init__(self, root: str, keep_last: int, async_save: bool = False):
        self.root, self.keep_last = root, keep_last
        self.async_save = async_save
        self._pending: Future | None = None  # the background part of the save in flight
        self._pending_step = -1
        self._pool: ThreadPoolExecutor | None = None
        self._stager = None
        self._group = None
        self.stall_parts: dict[str, float] = {}  # seconds of the last save's parts that training waited for
        if async_save:
            # Background collectives must not share a group with the training loop's (NCCL or
            # gloo ops issued from two threads on one group can interleave differently per rank).
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spmd_rl-checkpoint")
            self._stager = make_stager()

    # ------------------------------------------------------------------ finding checkpoints
    def complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for d in os.listdir(self.root) if (m := _STEP_DIR.match(d)))

    def _pointer(self) -> str | None:
        pointer = os.path.join(self.root, "latest")
        if not os.path.isfile(pointer):
            return None
        with open(pointer) as f:
            return f.read().strip() or None

    def latest(self) -> str | None:
        """The newest committed checkpoint (by the `latest` pointer, else the newest step_N), or
        None. Not verified: see find_resume."""
        name = self._pointer()
        if name and os.path.isdir(os.path.join(self.root, name)):
            return os.path.join(self.root, name)
        steps = self.complete_steps()
        return os.path.join(self.root, f"step_{steps[-1]}") if steps else None

    def has_checkpoints(self) -> bool:
        return self._pointer() is not None or bool(self.complete_steps())

    def find_resume(self, resume: str) -> str | None:
        """The checkpoint to resume from for trainer.resume = `resume` ("auto", "none" or a path),
        verified; None = start fresh. Rank 0 decides (and warns), every rank gets its answer."""
        if resume == "none":
            return None
        answer: list[Any] = [None]
        if _rank() == 0:
            try:
                answer[0] = ("ok", self._choose(resume))
            except CheckpointError as e:
                answer[0] = ("error", str(e))
        if dist.is_initialized():
            dist.broadcast_object_list(answer, src=0, group=self._group)
        kind, value = answer[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def _choose(self, resume: str) -> str | None:
        if resume != "auto":
            problem = verify(resume, _world())
            if problem:
                raise CheckpointError(f"trainer.resume = {resume!r} is not a complete checkpoint: {problem}. "
                                      "Pass a complete step_N directory, or trainer.resume=auto")
            return resume
        name = self._pointer()
        newest = int(name.split("_")[1]) if name and _STEP_DIR.match(name) else None
        # The `latest` pointer is the head of the run's timeline: step dirs past it are from a
        # timeline abandoned by an explicit resume, so candidates are the pointer's and older ones.
        steps = [s for s in reversed(self.complete_steps()) if newest is None or s <= newest]
        if newest is not None and newest not in steps:
            log.warning("checkpoints/latest names %s, which is missing; using the newest older one", name)
        broken = []
        for s in steps:
            path = os.path.join(self.root, f"step_{s}")
            problem = verify(path, _world())
            if problem is None:
                if broken:
                    log.warning("checkpoint %s is broken (%s): resuming from %s instead", broken[0][0],
                                broken[0][1], path)
                return path
            broken.append((path, problem))
            log.warning("checkpoint %s is broken: %s", path, problem)
        if broken or newest is not None:
            raise CheckpointError(
                f"{self.root} holds checkpoints but none is complete ({len(broken)} broken, e.g. "
                f"{broken[0][0] if broken else name}: {broken[0][1] if broken else 'missing'}): move that "
                "directory away to start fresh, or pass a good checkpoint as trainer.resume")
        if os.path.isdir(self.root) and any(d.endswith(".tmp") for d in os.listdir(self.root)):
            log.warning("%s holds only unfinished saves (*.tmp): starting from step 0", self.root)
        return None

    # ------------------------------------------------------------------ saving
    def save(self, step: int, models: dict[str, Stateful], trainer_state: dict[str, Any]) -> str:
        """Checkpoint step `step` as `<root>/step_<step>`. Collective. Synchronous: returns once
        it is complete. Asynchronous: returns once the state is staged in host memory; the write
        and commit go on in the background (wait() for them). Raises CheckpointError if the
        previous asynchronous save failed."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; its failure surfaces here
        self.stall_parts = {"previous_save": time.perf_counter() - t0}
        final = os.path.join(self.root, f"step_{step}")
        tmp = final + ".tmp"
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            for d in os.listdir(self.root):  # leftovers of interrupted saves (none is in flight now)
                if d.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        torch.save(trainer_state, os.path.join(tmp, f"trainer_state_rank{_rank()}.pt"))
        if not self.async_save:
            dcp.save(dict(models), checkpoint_id=tmp, storage_writer=_writer(tmp))
            self._finish(step, None)
            self._barrier()
            return final
        t0 = time.perf_counter()
        state = {name: model.state_dict() for name, model in models.items()}  # what DCP would ask the Statefuls
        t1 = time.perf_counter()
        with warnings.catch_warnings():  # torch >= 2.10 deprecates the synchronize_staging it calls itself
            warnings.simplefilter("ignore", FutureWarning)
            upload = dcp.async_save(state, checkpoint_id=tmp, storage_writer=_writer(tmp), process_group=self._group,
                                    async_stager=self._stager)
        self.stall_parts.update(state_dict=t1 - t0, staging=time.perf_counter() - t1)
        upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse when staging is async
        self._pending = self._pool.submit(self._finish, step, upload)
        self._pending_step = step
        self._pending.add_done_callback(lambda fut: _report(step, fut))
        return final

    def _finish(self, step: int, upload: Future | None) -> None:
        """After this rank's write: rank 0 verifies and commits (every rank's files are written
        once DCP's save returns: its last collective follows every rank's write)."""
        if upload is not None:
            upload.result()
        fault = _fault(step)
        if fault and fault[0] == "delay":
            time.sleep(fault[1])
        if fault and fault[0] == "fail":
            raise OSError(f"injected failure ({FAULT_ENV}={os.environ[FAULT_ENV]})")
        if _rank() == 0:
            self._commit(step)

    def _commit(self, step: int) -> None:
        final = os.path.join(self.root, f"step_{step}")
        tmp = final + ".tmp"
        problem = verify(tmp, _world())
        if problem:
            raise CheckpointError(f"checkpoint of step {step} failed verification after writing: {problem}")
        manifest = {"step": step, "world_size": _world(), "files": _files(tmp)}
        with open(os.path.join(tmp, MANIFEST + ".tmp"), "w") as f:
            json.dump(manifest, f)
        os.replace(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
        if os.path.isdir(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(self.root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
        # keep the newest keep_last up to this step; later ones are overwritten as the run gets there
        older = [s for s in self.complete_steps() if s <= step]
        for old in older[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.root, f"step_{old}"), ignore_errors=True)
        log.info("checkpoint step_%d complete", step)

    def in_flight(self) -> bool:
        """Whether this rank's part of the last asynchronous save is still running."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Wait for the save in flight, if any. Collective when one was in flight. Raises
        CheckpointError on every rank if it failed on any rank."""
        if self._pending is None:
            return
        fut, step = self._pending, self._pending_step
        self._pending = None
        error = fut.exception()  # blocks until the background part is done
        failed = torch.tensor([error is not None], dtype=torch.int32)
        if dist.is_initialized():  # every rank raises, or none: the next collective stays matched
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._group)
        if failed.item():
            where = f": {_describe(error)}" if error is not None else " on another rank (see its log)"
            raise CheckpointError(f"the checkpoint of step {step} failed{where}; the previous complete "
                                  "checkpoint stays the latest") from None

    def close(self) -> None:
        """Wait for the save in flight (a failure is logged, not raised: close runs on error paths
        too), then stop the writer thread and free the staging buffers. Idempotent."""
        try:
            self.wait()
        except CheckpointError as e:
            log.error("%s", e)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self._group)

    # ------------------------------------------------------------------ loading
    def load(self, path: str, models: dict[str, Stateful]) -> dict[str, Any]:
        """Restore models/optimizers in place; returns this rank's trainer state. DCP reads only
        each rank's own shards, straight into the FSDP parameters and optimizer states, resharding
        them when the world size changed (saved_world_size). Then every rank takes rank 0's trainer
        state: all of it but the RNG states is the same on every rank, and the RNG states of
        another layout's ranks mean nothing here."""
        saved_world = saved_world_size(path)
        state_file = os.path.join(path, f"trainer_state_rank{_rank() if saved_world == _world() else 0}.pt")
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


def saved_world_size(path: str) -> int:
    """Ranks of the run that wrote the checkpoint `path`: its manifest's count, else (checkpoints
    of older versions) its trainer state files'."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return sum(1 for n in os.listdir(path) if re.fullmatch(r"trainer_state_rank\d+\.pt", n))


def _describe(error: BaseException) -> str:
    """One line for an error of the background save (DCP's CheckpointException carries every
    failed rank's exception and traceback: keep the exceptions)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items()))
    return f"{type(error).__name__}: {error}"


def _report(step: int, fut: Future) -> None:
    if fut.exception() is not None:  # logged as it happens; raised by the next save / wait()
        log.error("checkpoint of step %d failed in the background (the previous one stays the latest): %s",
                  step, _describe(fut.exception()))
