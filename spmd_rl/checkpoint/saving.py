"""The write side of checkpoints: a save, synchronous or asynchronous, its commit, the room it
needs on disk, and the older checkpoints beyond `keep_last` removed after it
(spmd_rl/checkpoint/checkpointer.py has the directory's layout).

A save writes `step_N.tmp`; once every rank's files are written, rank 0 verifies them against
DCP's `.metadata` (reading.verify), writes `manifest.json` (every file and its size, the run
directory, the format and the package version: spmd_rl/checkpoint/manifest.py), renames the
directory to `step_N` and only then points `latest` at it (write + os.replace). A crash at any
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
(spmd_rl/checkpoint/writes.py, `describe`; torch's zip writer's "unexpected pos N vs M", which
hides it, is never shown) and the free space left; training goes on. A failure of any other kind
(a bug, a verification that fails without a write error) raises CheckpointError on every rank.

Asynchronous saves (`async_save`): the training step only waits while the state is copied to host
memory (`dcp.async_save` with spmd_rl/checkpoint/staging.py's HostStager: host buffers allocated
once, pinned on GPU machines, reused by every save); the files are written, checked and committed
by a background thread while the next steps train, over the checkpointer's own gloo process group
(the training collectives keep theirs). At most one save is in flight: the next save, `wait()` and
`close()` wait for it.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.stateful import Stateful

from spmd_rl.checkpoint import manifest as manifest_format
from spmd_rl.checkpoint import space, writes
from spmd_rl.checkpoint.reading import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    complete_steps,
    current_rank,
    current_world,
    pointer,
    verify,
)
from spmd_rl.checkpoint.staging import make_stager

log = logging.getLogger("spmd_rl.checkpoint.checkpointer")  # the read and the write side log as the checkpointer

WRITE_THREADS = min(8, os.cpu_count() or 1)
"""Threads (and files) per rank that write a checkpoint. DCP's default is one: a rank's shards then
go through one thread's serialisation, which bounds the save at the end of a run and, when a write
outlasts the steps between saves, the next save's stall (docs/performance.md, "Why the defaults
are what they are")."""
FAULT_ENV = "SPMD_RL_CHECKPOINT_FAULT"
"""Test hook, read after a save's files are written: "fail@N" makes the save of step N fail as on
a full disk (an ENOSPC write failure on every rank), "fail@N+" every save from step N on;
"delay@N:S" holds the commit of step N back S seconds (a save in flight)."""

_OK, _WRITE_FAILED, _OTHER_FAILURE = 0, 1, 2  # how a save ended (CheckpointSaver._agree), worst last


class CheckpointSaver:
    """Writes the checkpoints under `root`: `save` (collective), the commit, the room on disk and the
    pruning to `keep_last`. `group`: the checkpointer's own gloo process group (None: one process).
    `run_dir`: recorded in each checkpoint's manifest."""

    def __init__(self, root: str, keep_last: int, async_save: bool, run_dir: str, group: dist.ProcessGroup | None):
        self.root, self.keep_last = root, keep_last
        self.async_save = async_save
        self.run_dir = run_dir
        self._group = group
        self._pending: Future | None = None  # the background part of the save in flight
        self._pool: ThreadPoolExecutor | None = None
        self._stager = None
        self.stall_parts: dict[str, float] = {}  # seconds of the last save's parts that training waited for
        if async_save:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spmd_rl-checkpoint")
            self._stager = make_stager()

    # ------------------------------------------------------------------ disk space
    def log_space_plan(self, planned: dict[str, Any], trainer_state: dict[str, Any]) -> None:
        """The start-up line (space.plan_line): bytes of a save of the states `planned` (by model
        name, ModelAndOptimizer.planned_state), keep_last, the peak on disk, the free space; a
        warning with the fix when they do not fit. Collective."""
        size = space.measure(planned, trainer_state, self._group)
        if current_rank() == 0:
            free, mount = space.free_space(self.root)
            held = sum(space.dir_bytes(os.path.join(self.root, d)) for d in os.listdir(self.root)
                       if STEP_DIR.match(d) or d.endswith(".tmp")) if os.path.isdir(self.root) else 0
            level, line = space.plan_line(size, self.keep_last, free, held, self.root, mount)
            log.log(level, "%s", line)

    def _prepare(self, step: int, size: space.CheckpointSize) -> bool:
        """Make room for the save of `step` and its `.tmp` directory, or decide to skip it: rank 0
        decides (the checkpoint directory is one filesystem every rank sees) and every rank gets its
        answer. Removes leftovers of interrupted saves, then, when the free space is short of the
        save's bytes (+ HEADROOM), the older checkpoints the save would remove anyway
        (space.removable), oldest first. Skipped: one warning line. Collective."""
        answer: list[Any] = [True]
        if current_rank() == 0:
            try:
                answer[0] = self._make_room(step, size)
            except OSError as e:  # creating or removing directories failed
                log.error("checkpoint of step %d not written: %s; %s stays the latest; training goes on", step,
                          writes.describe(e), pointer(self.root) or "no checkpoint")
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
        latest = pointer(self.root)
        latest_step = int(latest.split("_")[1]) if latest and STEP_DIR.match(latest) else None
        for old in space.removable(complete_steps(self.root), latest_step, step, self.keep_last):
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
        writer = writes.writer(tmp, WRITE_THREADS)
        state_file = os.path.join(tmp, f"trainer_state_rank{current_rank()}.pt")
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
            if current_rank() == 0:
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
        mine = _OK if error is None else _WRITE_FAILED if writes.is_write_error(error) else _OTHER_FAILURE
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
            mine = writes.describe(error, where) if writes.is_write_error(error) else _describe(error)
        reasons = [mine]
        if dist.is_initialized():
            reasons = [None] * current_world()
            dist.all_gather_object(reasons, mine, group=self._group)
        failed = [f"rank {r}: {why}" for r, why in enumerate(reasons) if why]
        reason = failed[0] + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")
        latest = pointer(self.root) or "no checkpoint"
        if verdict != _WRITE_FAILED:
            if current_rank() == 0:
                shutil.rmtree(os.path.join(self.root, f"step_{step}.tmp"), ignore_errors=True)
                log.error("checkpoint of step %d failed: %s; %s stays the latest", step, reason, latest)
            raise CheckpointError(f"the checkpoint of step {step} failed: {reason}; {latest} stays the latest")
        if current_rank() == 0:
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
        problem = verify(tmp, current_world())
        if problem:
            raise CheckpointError(f"checkpoint of step {step} failed verification after writing: {problem}")
        manifest = manifest_format.written(step, current_world(), self.run_dir, _files(tmp))
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
        older = [s for s in complete_steps(self.root) if s <= step]
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


def _fault(step: int) -> tuple[str, float] | None:
    spec = os.environ.get(FAULT_ENV, "")
    m = re.fullmatch(r"(fail|delay)@(\d+)(\+?)(?::([\d.]+))?", spec)
    if not m or not (step == int(m.group(2)) or (m.group(3) and step > int(m.group(2)))):
        return None
    return m.group(1), float(m.group(4) or 0)


def _describe(error: BaseException) -> str:
    """One line for a failed save that is not a write error (DCP's CheckpointException carries every
    failed rank's exception and traceback: keep the exceptions)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items()))
    return f"{type(error).__name__}: {error}"
