"""Stop cleanly when the scheduler says so: a signal sets a flag, the trainer checks it per step.

Ctrl-C (SIGINT) stops the same way: the current step ends, a checkpoint is written. A second stop
signal after a SIGINT (a second Ctrl-C: torchrun passes it on as SIGTERM) raises KeyboardInterrupt
at once, without a checkpoint.

SLURM announces the end of a job with signals: SIGTERM on preemption, cancellation and at the
time limit (then SIGKILL after `KillWait`/`GraceTime`), and the `--signal` user signal some time
before the time limit (submitit asks for SIGUSR2, `#SBATCH --signal=USR2@90`; many sites use
SIGUSR1). Acting inside a signal handler would cut a step in half, so the handlers here only
record the signal; the trainer asks after every step:

    stop = StopFlag.install()
    for step in ...:
        train_step()
        if stop.requested():          # collective: every rank calls it, every rank gets the same answer
            save_checkpoint()
            return EXIT_PREEMPTED

`requested()` all-reduces the flag (MAX) over the process group, so all ranks stop after the same
step even when the signal reached only some of them. Whether the job then goes back to the queue is
the launcher's business (launch/task.py): it requeues after the user signals and after the SIGTERM
of a preemption, not after a plain SIGTERM (a cancelled job must stay cancelled).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from typing import Any, ClassVar

EXIT_STATUS_DIR_ENV = "SPMD_RL_EXIT_STATUS_DIR"
"""A folder the launcher names when it cannot see its ranks' exit statuses: torchrun reports a
worker's status 3 and 4 alike as its own failure (1), and only 3 means "requeue". Each rank then
writes its status there, in `rank_<RANK>` (`record_exit_status`), and the SLURM task that ran
torchrun reads them (`recorded_exit_statuses`, launch/task.py)."""

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that ask the trainer to stop: SLURM's SIGTERM, Ctrl-C and the usual `--signal` choices."""

REQUEUE_SIGNALS: frozenset[signal.Signals] = frozenset({signal.SIGUSR1, signal.SIGUSR2})
"""Signals meaning "time is up, come back later" (the `--signal` warning before the time limit, or
SLURM's preemption notice with PreemptParameters=send_user_signal): the launcher requeues on them."""


class StopFlag:
    """Process-wide record of stop signals; get it with `StopFlag.install()`."""

    _instance: ClassVar[StopFlag | None] = None

    def __init__(self) -> None:
        self._local: set[signal.Signals] = set()  # received by this process
        self._seen: set[signal.Signals] = set()  # received by any rank, as of the last requested()
        self._previous: dict[signal.Signals, Any] = {}
        self._interrupted = False  # a second Ctrl-C came

    # ------------------------------------------------------------------ setup
    @classmethod
    def install(cls) -> StopFlag:
        """Install the handlers (once per process; later calls return the same flag).

        Must run in the main thread (Python delivers signals only there). The handlers that were
        in place before -- e.g. submitit's requeue handler -- are kept, see `previous_handler`.
        """
        if cls._instance is None:
            flag = cls()
            for sig in STOP_SIGNALS:
                flag._previous[sig] = signal.signal(sig, flag._handle)
            cls._instance = flag
        return cls._instance

    def previous_handler(self, sig: signal.Signals) -> Callable[..., Any] | int | None:
        """The handler `install` replaced for `sig` (SIG_DFL/SIG_IGN as ints, or a callable)."""
        return self._previous.get(sig)

    def _handle(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if signal.SIGINT in self._local and sig in (signal.SIGINT, signal.SIGTERM):
            # the second Ctrl-C (torchrun forwards it as SIGTERM): stop now. Python drops an exception
            # raised while a weakref callback or __del__ runs; requested() raises it again then.
            self._interrupted = True
            raise KeyboardInterrupt
        if sig in self._local:
            return
        self._local.add(sig)
        # os.write, not logging/print: the main thread may be inside a write to the same stream,
        # and re-entering a buffered writer from a handler raises RuntimeError.
        again = " (Ctrl-C again stops at once, without a checkpoint)" if sig == signal.SIGINT else ""
        msg = (f"[spmd_rl pid {os.getpid()}] received {sig.name}: finishing the current step, "
               f"then writing a checkpoint and stopping{again}\n")
        os.write(2, msg.encode())

    # ------------------------------------------------------------------ queries
    def local(self) -> bool:
        """Whether this process received a stop signal (no communication)."""
        return bool(self._local)

    def requested(self, group: Any = None) -> bool:
        """Whether any rank received a stop signal. COLLECTIVE when torch.distributed is
        initialized: every rank of `group` must call it at the same point (e.g. after each step).
        Raises KeyboardInterrupt after a second Ctrl-C whose own was lost (see `_handle`)."""
        if self._interrupted:
            raise KeyboardInterrupt
        self._seen |= self._local
        try:
            import torch
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a dependency; keep the module usable without
            return bool(self._seen)
        if dist.is_available() and dist.is_initialized():
            # Gloo takes CPU tensors; a pure NCCL group needs a CUDA one.
            on_cpu = "gloo" in str(dist.get_backend(group)) or not torch.cuda.is_available()
            device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
            bits = torch.tensor([sig in self._seen for sig in STOP_SIGNALS], dtype=torch.int32, device=device)
            dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
            self._seen |= {sig for sig, bit in zip(STOP_SIGNALS, bits.tolist()) if bit}
        return bool(self._seen)

    @property
    def signals(self) -> frozenset[signal.Signals]:
        """Signals received by this process or, as of the last `requested()`, by any rank."""
        return frozenset(self._seen | self._local)

    @property
    def requeue_requested(self) -> bool:
        """Whether one of the signals asks for a requeue (see REQUEUE_SIGNALS)."""
        return bool(self.signals & REQUEUE_SIGNALS)

    @classmethod
    def _uninstall(cls) -> None:
        """Restore the previous handlers and forget the flag (for tests)."""
        if cls._instance is not None:
            for sig, handler in cls._instance._previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            cls._instance = None


def record_exit_status(code: int, message: str | None = None) -> None:
    """Write this rank's exit status into the folder EXIT_STATUS_DIR_ENV names (nothing when unset),
    and `message`, the lines this rank has for the user at its exit (its `error:` line, where to
    resume), into `rank_<RANK>.message` beside it (`recorded_messages`). Each is written to a
    temporary name and renamed, so a reader never sees half of it; the message goes first."""
    directory = os.environ.get(EXIT_STATUS_DIR_ENV)
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{os.environ.get('RANK', '0')}")
    for name, text in ((path + ".message", message), (path, f"{code}\n")):
        if text is not None:
            with open(name + ".tmp", "w") as f:
                f.write(text)
            os.replace(name + ".tmp", name)


def recorded_exit_statuses(directory: str) -> dict[int, int]:
    """Rank -> exit status, for the ranks that wrote one into `directory` (see EXIT_STATUS_DIR_ENV);
    a rank killed before it could write is missing."""
    found = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        m = re.fullmatch(r"rank_(\d+)", name)
        if m:
            with open(os.path.join(directory, name)) as f:
                found[int(m.group(1))] = int(f.read())
    return dict(sorted(found.items()))


def recorded_messages(directory: str) -> dict[int, str]:
    """Rank -> the message it recorded with its exit status (`record_exit_status`)."""
    found = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        m = re.fullmatch(r"rank_(\d+)\.message", name)
        if m:
            with open(os.path.join(directory, name)) as f:
                found[int(m.group(1))] = f.read()
    return dict(sorted(found.items()))
