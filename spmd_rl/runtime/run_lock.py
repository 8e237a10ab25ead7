"""One run per run directory: rank 0 holds an exclusive lock on `<run_dir>/.lock` for its lifetime
(and on `<checkpoint_dir>/.lock` when trainer.checkpoint_dir is outside the run directory).

`fcntl.flock` locks belong to the open file, so the kernel drops the lock the moment the process
dies (also on SIGKILL or a node crash of a local disk): a dead run never blocks the next one, and
no stale-lock cleanup is needed. The file records who holds it, for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

from spmd_rl.errors import UserError

LOCK_NAME = ".lock"


class RunDirInUse(UserError):
    """Another live run holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: str, key: str = "trainer.run_dir"):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.key = key  # the config key that names the directory, for the refusal
        self._file = None

    def acquire(self) -> None:
        """Take the lock, or raise RunDirInUse naming the holder. Never blocks."""
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            run_dir = os.path.dirname(self.path)
            raise RunDirInUse(f"{self.key} {run_dir!r} is in use by a running job ({holder}): wait for it to "
                              f"finish or stop it, or choose another {self.key}") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
