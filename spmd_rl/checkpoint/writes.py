"""Failed checkpoint writes, told by their OS error instead of torch's zip writer's.

DCP writes each tensor of a checkpoint with torch.save into the open file. When the OS refuses a
write (ENOSPC: the disk is full, EDQUOT: a quota, EIO), torch.save's zip writer replaces that
OSError by an error of its own, raised while torch.save closes its archive. Measured on torch 2.13,
saving 48 MiB of model + AdamW state into a 20 MiB tmpfs, synchronously and asynchronously, as
spmd_rl/checkpoint/saving.py saves (and the same text a 1.5B run printed with its disk full on torch 2.11):

    RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598
    (its __context__: OSError: [Errno 28] No space left on device)

DCP pickles each rank's failure to share it with the other ranks, and the OSError, which was only
the __context__, is lost there. Worse, a write that fails in one of DCP's extra writer threads
(FileSystemWriter(thread_count > 1)) is not reported at all: the thread dies with a traceback on
stderr, DCP's save returns, and the .metadata it writes lacks that thread's items.

`RecordingFileSystem`, the file system of the checkpointer's writer (`writer`), keeps the OSError
and the file of every failed write, and ends that file quietly (no traceback, DCP goes on to the
next file); the checkpointer asks it after each save and fails the save with the first one
(saving.CheckpointSaver._complete), naming its errno (`describe`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from typing import NamedTuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

ZIP_WRITER_ERROR = "inline_container.cc"
"""Text of torch's zip writer errors: one without an OSError behind it (a failure shared by DCP
from another rank) is still a failed write; its errno is lost."""


class WriteFailure(NamedTuple):
    path: str  # the file being written
    error: BaseException  # the OSError when there is one, else torch's zip writer error


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc`: itself, one it was raised from or while handling, or one of the
    ranks' failures a DCP CheckpointException carries."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        for failure, _ in (getattr(exc, "failures", None) or {}).values():
            if (found := os_error(failure)) is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def is_write_error(exc: BaseException | None) -> bool:
    """Whether `exc` means that writing a file failed: an OSError is behind it, or it is torch's
    zip writer's (whose OSError was lost on the way)."""
    return exc is not None and (os_error(exc) is not None or ZIP_WRITER_ERROR in str(exc))


def describe(error: BaseException, path: str = "") -> str:
    """One phrase: `[Errno 28] No space left on device (ENOSPC) writing PATH`."""
    err = os_error(error)
    path = path or (getattr(err, "filename", None) or "")
    where = f" writing {path}" if path else ""
    if err is None:  # torch's zip writer's error, its OSError lost: that a write failed is all it tells
        return f"{f'writing {path}' if path else 'a write'} failed (its OS error was lost on the way; see the free space)"
    name = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    text = f"[Errno {err.errno}] {err.strerror}" if err.strerror else str(err)
    return f"{text}{f' ({name})' if name else ''}{where}"


class RecordingFileSystem(FileSystem):
    """DCP's local file system, keeping every failed write (`failures`) instead of letting torch's
    zip writer replace its OSError. A write error inside an open file ends that file quietly: the
    save goes on to its other files and is failed afterwards by whoever reads `failures`. An error
    opening a file still raises (DCP reports it; its OSError survives DCP's pickling)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[WriteFailure] = []
        self._lock = threading.Lock()

    def record(self, path: str | os.PathLike, exc: BaseException) -> bool:
        """Keep `exc` if it is a write error (True); anything else is the caller's to raise."""
        if not is_write_error(exc):
            return False
        with self._lock:
            self.failures.append(WriteFailure(str(path), os_error(exc) or exc))
        return True

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        opened = False
        try:
            with super().create_stream(path, mode) as stream:
                opened = True
                yield stream
        except Exception as e:
            if not self.record(path, e) or not opened:
                raise

    def first_failure(self) -> WriteFailure | None:
        with self._lock:
            return self.failures[0] if self.failures else None


def writer(path: str, thread_count: int) -> dcp.FileSystemWriter:
    """DCP's file writer with `thread_count` threads (each writing its own file of this rank's
    shards) on a RecordingFileSystem: `writer(...).fs.failures` after the save."""
    w = dcp.FileSystemWriter(path, thread_count=thread_count)
    w.fs = RecordingFileSystem()
    return w
