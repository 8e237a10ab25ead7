"""Checkpoints: sharded model/optimizer state through torch.distributed.checkpoint (DCP), plus
each rank's small training state (step, data position, schedulers, RNG) as a torch file.

Layout under the checkpoint directory (trainer.checkpoint_dir, by default <run_dir>/checkpoints):

    step_12/                 a complete checkpoint: DCP files, trainer_state_rank{r}.pt, manifest.json
    step_12.tmp/             a save in progress (or abandoned by a crash); never read, removed by the next save
    latest                   text: the name of the newest complete checkpoint

A save writes `step_N.tmp`; once every rank's files are written, rank 0 verifies them against
DCP's `.metadata`, writes `manifest.json` (every file and its size, the run directory, the format
and the package version: spmd_rl/checkpoint/manifest.py), renames
the directory to `step_N` and only then points `latest` at it (write + os.replace). A crash at any
moment leaves `latest` on a complete checkpoint. Older checkpoints beyond `keep_last` are deleted
after that.

Disk space (spmd_rl/checkpoint/space.py): the start-up line gives the bytes of a save, keep_last,
the peak a save needs on disk and the free space there, with a warning and the fix when they do
not fit. Before each save rank 0 measures the free space of the checkpoint directory (one
filesystem every rank sees) and decides for all ranks: when the save does not fit, it first
removes the older checkpoints the save would remove anyway (never the latest complete one);
when it still does not fit, the save is skipped with one warning line (needed, free, where) and
training goes on; the next save tries again.

A write that fails anyway (ENOSPC, EDQUOT, EIO, on any rank, in a synchronous save or in the
background): the ranks agree that it failed, rank 0 removes the partial `step_N.tmp`, `latest`
stays on the previous complete checkpoint, and one error line names the errno
(checkpoint_writes.describe; torch's zip writer's "unexpected pos N vs M", which hides it, is
never shown) and the free space left; training goes on. A failure of any other kind (a bug, a
verification that fails without a write error) raises CheckpointError on every rank.
The trainer's last save (end of training, or a stop signal) follows the same rules; when it is not
written the run exits with EXIT_NOT_SAVED (4), never 0 or the requeue status 3
(spmd_rl/trainer.py Trainer.fit).

Asynchronous saves (`trainer.async_save`): the training step only waits while the state is copied
to host memory (`dcp.async_save` with checkpoint_staging.HostStager: host buffers allocated once,
pinned on GPU machines, reused by every save); the files are written, checked and committed by a
background thread while the next steps train, over a gloo process group of the checkpointer's own
(the training collectives keep theirs). At most one save is in flight: the next save, `wait()` and
`close()` wait for it.

Resuming (`find_resume`) verifies a checkpoint before trusting it -- `manifest.json` sizes, every
byte range DCP's `.metadata` references and every item it lists, a trainer state per rank -- and
falls back to the newest complete one with a warning naming the broken one. Checkpoints that exist
but are all broken are an error (CheckpointError, one line), never a silent restart from step 0.
"""

from __future__ import annotations

import collections
import errno
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from spmd_rl.checkpoint import manifest as manifest_format
from spmd_rl.checkpoint import space as space
from spmd_rl.checkpoint import writes as checkpoint_writes
from spmd_rl.checkpoint.staging import make_stager

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = manifest_format.MANIFEST
WRITE_THREADS = min(8, os.cpu_count() or 1)
"""Threads (and files) per rank that write a checkpoint. DCP's default is one: a rank's shards then
go through one thread's serialisation, which bounds the save at the end of a run and, when a write
outlasts the steps between saves, the next save's stall (docs/performance.md, "Why the defaults
are what they are")."""
FAULT_ENV = "SPMD_RL_CHECKPOINT_FAULT"
"""Test hook, read after a save's files are written: "fail@N" makes the save of step N fail as on
a full disk (an ENOSPC write failure on every rank), "fail@N+" every save from step N on;
"delay@N:S" holds the commit of step N back S seconds (a save in flight)."""
EXIT_NOT_SAVED = 4
"""Exit status of a run whose last checkpoint (at the end of training, or on a stop signal) was not
written: skipped for lack of disk space, or its write failed. The log names why and the latest
complete checkpoint; a requeue would only repeat it, so this is not EXIT_PREEMPTED."""


_OK, _WRITE_FAILED, _OTHER_FAILURE = 0, 1, 2  # how a save ended (Checkpointer._agree), worst last


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or trusted; the message names it and the fix."""


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
        """What state_dict() holds, to measure it (checkpoint_space), without creating the
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
    thread that died leaves (DCP does not notice; checkpoint_writes)."""
    have = collections.Counter(index.fqn for index in metadata.storage_data)
    expected = {fqn: len(md.chunks) if hasattr(md, "chunks") else 1 for fqn, md in metadata.state_dict_metadata.items()}
    return sum(max(0, n - have.get(fqn, 0)) for fqn, n in expected.items())


def _fault(step: int) -> tuple[str, float] | None:
    spec = os.environ.get(FAULT_ENV, "")
    m = re.fullmatch(r"(fail|delay)@(\d+)(\+?)(?::([\d.]+))?", spec)
    if not m or not (step == int(m.group(2)) or (m.group(3) and step > int(m.group(2)))):
        return None
    return m.group(1), float(m.group(4) or 0)


# --------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and finds checkpoints under `root`. Build it on every rank (collectively: it creates a
    gloo process group of its own) and `close()` it before the process group is destroyed.
    `run_dir`: recorded in each checkpoint's manifest (the export and the resume check find the
    run's config.toml there when `root` is elsewhere)."""

    def __init__(self, root: str, keep_last: int, async_save: bool = False, run_dir: str = ""):
        self.root, self.keep_last = root, keep_last
        self.async_save = async_save
        self.run_dir = os.path.abspath(run_dir or os.path.dirname(os.path.abspath(root)))
        self._pending: Future | None = None  # the background part of the save in flight
        self._pool: ThreadPoolExecutor | None = None
        self._stager = None
        self.stall_parts: dict[str, float] = {}  # seconds of the last save's parts that training waited for
        # The checkpointer's collectives (decisions, agreement on failures, DCP's own) run on a gloo
        # group of its own: CPU tensors, and background collectives must not share a group with the
        # training loop's (ops issued from two threads on one group can interleave differently per rank).
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if async_save:
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

    # ------------------------------------------------------------------ disk space
    def log_space_plan(self, models: dict[str, ModelAndOptimizer], trainer_state: dict[str, Any]) -> None:
        """The start-up line (checkpoint_space.plan_line): bytes of a save, keep_last, the peak on
        disk, the free space; a warning with the fix when they do not fit. Collective."""
        size = space.measure({n: m.planned_state() for n, m in models.items()}, trainer_state, self._group)
        if _rank() == 0:
            free, mount = space.free_space(self.root)
            held = sum(space.dir_bytes(os.path.join(self.root, d)) for d in os.listdir(self.root)
                       if _STEP_DIR.match(d) or d.endswith(".tmp")) if os.path.isdir(self.root) else 0
            level, line = space.plan_line(size, self.keep_last, free, held, self.root, mount)
            log.log(level, "%s", line)

    def _prepare(self, step: int, size: space.CheckpointSize) -> bool:
        """Make room for the save of `step` and its `.tmp` directory, or decide to skip it: rank 0
        decides (the checkpoint directory is one filesystem every rank sees) and every rank gets its
        answer. Removes leftovers of interrupted saves, then, when the free space is short of the
        save's bytes (+ HEADROOM), the older checkpoints the save would remove anyway
        (checkpoint_space.removable), oldest first. Skipped: one warning line. Collective."""
        answer: list[Any] = [True]
        if _rank() == 0:
            try:
                answer[0] = self._make_room(step, size)
            except OSError as e:  # creating or removing directories failed
                log.error("checkpoint of step %d not written: %s; %s stays the latest; training goes on", step,
                          checkpoint_writes.describe(e), self._pointer() or "no checkpoint")
                answer[0] = False
            except Exception as e:  # raised on every rank below, not on rank 0 alone (the others would wait)
                answer[0] = f"the checkpoint of step {step} failed before writing: {_describe(e)}"
        if dist.is_initialized():
            dist.broadcast_object_list(answer, src=0, group=self._group)
        if isinstance(answer[0], str):
            raise CheckpointError(answer[0])
        return answer[0]

    def _make_room(self, step: int, size: space.CheckpointSize) -> bool:
        os.makedirs(self.root, exist_ok=True)
        for d in os.listdir(self.root):  # leftovers of interrupted saves (none is in flight now)
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)
        need = space.needed(size)
        free, mount = space.free_space(self.root)
        latest = self._pointer()
        latest_step = int(latest.split("_")[1]) if latest and _STEP_DIR.match(latest) else None
        for old in space.removable(self.complete_steps(), latest_step, step, self.keep_last):
            if free >= need:
                break
            shutil.rmtree(os.path.join(self.root, f"step_{old}"), ignore_errors=True)
            log.info("checkpoint step_%d removed before writing step_%d, to make room (it needs %s, %s were free)",
                     old, step, space.gb(need), space.gb(free))
            free, mount = space.free_space(self.root)
        if free < need:
            log.warning("checkpoint of step %d skipped: it needs %s (%s + %d%%), %s free on %s%s; training goes "
                        "on, the next save tries again. Fix: trainer.checkpoint_dir on a larger filesystem, a smaller "
                        "trainer.keep_last, or a larger trainer.save_every", step, space.gb(need), space.gb(size.total),
                        round(space.HEADROOM * 100), space.gb(free), space.where(mount, self.root),
                        f"; {latest} stays the latest" if latest else "; there is no checkpoint yet")
            return False
        os.makedirs(os.path.join(self.root, f"step_{step}.tmp"))
        return True

    # ------------------------------------------------------------------ saving
    def save(self, step: int, models: dict[str, Stateful], trainer_state: dict[str, Any]) -> str | None:
        """Checkpoint step `step` as `<root>/step_<step>`. Collective. Synchronous: returns once it
        is complete. Asynchronous: returns once the state is staged in host memory; the write and
        commit go on in the background (wait() for them). Returns None when the save is not
        written: skipped for lack of disk space, or (synchronous) its write failed; the line saying
        why is logged. Raises CheckpointError when the previous asynchronous save failed otherwise
        than writing (see wait())."""
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight; a failed one was reported when it failed
        t1 = time.perf_counter()
        state = {name: model.state_dict() for name, model in models.items()}  # what DCP would ask the Statefuls
        size = space.measure(state, trainer_state, self._group)
        t2 = time.perf_counter()
        self.stall_parts = {"previous_save": t1 - t0, "state_dict": t2 - t1}
        if not self._prepare(step, size):
            return None
        tmp = os.path.join(self.root, f"step_{step}.tmp")
        writer = checkpoint_writes.writer(tmp, WRITE_THREADS)
        state_file = os.path.join(tmp, f"trainer_state_rank{_rank()}.pt")
        try:
            with open(state_file, "wb") as f:  # a file object: an OSError of the write reaches us intact
                torch.save(trainer_state, f)
        except Exception as e:
            if not writer.fs.record(state_file, e):
                raise
        if not self.async_save:
            error = None
            try:
                dcp.save(state, checkpoint_id=tmp, storage_writer=writer, process_group=self._group)
            except (Exception, dcp.CheckpointException) as e:  # raised on every rank alike (DCP gathers the failures)
                error = e
            return os.path.join(self.root, f"step_{step}") if self._complete(step, None, writer, error) else None
        with warnings.catch_warnings():  # torch >= 2.10 deprecates the synchronize_staging it calls itself
            warnings.simplefilter("ignore", FutureWarning)
            upload = dcp.async_save(state, checkpoint_id=tmp, storage_writer=writer, process_group=self._group,
                                    async_stager=self._stager)
        self.stall_parts["staging"] = time.perf_counter() - t2
        upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse when staging is async
        self._pending = self._pool.submit(self._complete, step, upload, writer)
        return os.path.join(self.root, f"step_{step}")

    def _complete(self, step: int, upload: Future | None, writer: dcp.FileSystemWriter,
                  error: BaseException | None = None) -> bool:
        """After this rank's write (`upload`: the asynchronous one's future): the ranks agree whether
        every write succeeded, then rank 0 verifies and commits, and the ranks agree whether that
        worked. True: step_N is complete and the latest. False: a write failed on some rank; its
        line is logged and the partial directory removed (`_failed`). Raises CheckpointError on
        every rank for a failure of another kind. Collective: on the checkpointer's group, from the
        background thread for asynchronous saves (the next save waits for it first)."""
        try:
            if upload is not None:
                upload.result()
            self._inject_fault(step, writer)
        except (Exception, dcp.CheckpointException) as e:  # every rank gets to the agreement below
            error = error or e
        failure = writer.fs.first_failure()  # the OS error, where DCP has only the zip writer's (or nothing)
        if failure is not None:
            error, where = failure.error, failure.path
        else:
            where = ""
        verdict = self._agree(error)
        if verdict == _OK:
            if _rank() == 0:
                try:
                    self._commit(step)
                except Exception as e:
                    error, where = e, getattr(e, "filename", "") or ""
            verdict = self._agree(error)
        if verdict == _OK:
            return True
        return self._failed(step, verdict, error, where)

    def _agree(self, error: BaseException | None) -> int:
        """The worst outcome over the ranks: _OK, _WRITE_FAILED or _OTHER_FAILURE. Collective."""
        mine = _OK if error is None else _WRITE_FAILED if checkpoint_writes.is_write_error(error) else _OTHER_FAILURE
        verdict = torch.tensor([mine], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self._group)
        return int(verdict.item())

    def _failed(self, step: int, verdict: int, error: BaseException | None, where: str) -> bool:
        """A save that failed on some rank: every rank learns why, rank 0 removes the partial
        directory and logs one line (a write error: with its errno and the free space left), and the
        previous complete checkpoint stays the latest. A write error returns False (training goes
        on); any other failure raises CheckpointError on every rank. Collective."""
        mine = None
        if error is not None:
            mine = (checkpoint_writes.describe(error, where) if checkpoint_writes.is_write_error(error)
                    else _describe(error))
        reasons = [mine]
        if dist.is_initialized():
            reasons = [None] * _world()
            dist.all_gather_object(reasons, mine, group=self._group)
        failed = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
        reason = failed[0] + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
        latest = self._pointer() or "no checkpoint"
        if verdict != _WRITE_FAILED:
            if _rank() == 0:
                shutil.rmtree(os.path.join(self.root, f"step_{step}.tmp"), ignore_errors=True)
                log.error("checkpoint of step %d failed: %s; %s stays the latest", step, reason, latest)
            raise CheckpointError(f"the checkpoint of step {step} failed: {reason}; {latest} stays the latest")
        if _rank() == 0:
            free, mount = space.free_space(self.root)  # before the partial directory goes: what the write left
            tmp = os.path.join(self.root, f"step_{step}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            log.error("checkpoint of step %d not written: %s; %s free on %s when it failed; removed %s, %s stays the "
                      "latest; training goes on", step, reason, space.gb(free), space.where(mount, self.root), tmp,
                      latest)
        return False

    def _inject_fault(self, step: int, writer: dcp.FileSystemWriter) -> None:
        fault = _fault(step)
        if fault and fault[0] == "delay":
            time.sleep(fault[1])
        if fault and fault[0] == "fail":
            writer.fs.record(writer.path, OSError(errno.ENOSPC, f"No space left on device (injected: "
                                                                f"{FAULT_ENV}={os.environ[FAULT_ENV]})"))

    def _commit(self, step: int) -> None:
        final = os.path.join(self.root, f"step_{step}")
        tmp = final + ".tmp"
        problem = verify(tmp, _world())
        if problem:
            raise CheckpointError(f"checkpoint of step {step} failed verification after writing: {problem}")
        manifest = manifest_format.written(step, _world(), self.run_dir, _files(tmp))
        with open(os.path.join(tmp, MANIFEST + ".tmp"), "w") as f:
            json.dump(manifest, f)
        os.replace(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
        if os.path.isdir(final):  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        try:
            with open(os.path.join(self.root, "latest.tmp"), "w") as f:
                f.write(f"step_{step}\n")
            os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
        except BaseException:  # `latest` still names the previous checkpoint: this one never was complete
            shutil.rmtree(final, ignore_errors=True)
            raise
        # keep the newest keep_last up to this step; later ones are overwritten as the run gets there
        older = [s for s in self.complete_steps() if s <= step]
        for old in older[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.root, f"step_{old}"), ignore_errors=True)
        log.info("checkpoint step_%d complete", step)

    def in_flight(self) -> bool:
        """Whether this rank's part of the last asynchronous save is still running."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> bool:
        """Wait for the save in flight, if any. True: none was in flight, or it is complete. False:
        its write failed (reported when it failed; the previous complete checkpoint stays the
        latest). Raises CheckpointError on every rank when it failed otherwise."""
        if self._pending is None:
            return True
        fut, self._pending = self._pending, None
        return fut.result()

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


def _describe(error: BaseException) -> str:
    """One line for a failed save that is not a write error (DCP's CheckpointException carries every
    failed rank's exception and traceback: keep the exceptions)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items()))
    return f"{type(error).__name__}: {error}"
