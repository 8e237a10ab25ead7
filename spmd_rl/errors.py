"""Errors a user can fix, and how the entry points report them.

Every exception that means "your input is wrong" (config, data, model and tokenizer directories,
reward function, run directory, checkpoint, export) derives from `UserError`. The entry points catch it and print its message
as one line on rank 0 and exit with `EXIT_USER_ERROR`, instead of a traceback per rank: the
message itself names the problem and the fix. An error of one rank's own state (a step out of GPU
memory: `report(..., per_rank=True)`) is one line on every rank that has it, naming the rank.

Under the `spmd-rl` launcher (spmd_rl/launcher.py, LAUNCHER_REPORTS_ENV) a rank prints none of
its closing lines (`say_last`): it records them with its exit status, and the launcher prints
the failing rank's lines last, after torchrun's own output.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from spmd_rl.exit_codes import EXIT_USER_ERROR

RANK0_GRACE_S = 20.0
"""How long a rank other than 0 that hit a user error waits for rank 0 to report it (see
`let_rank0_report_first`)."""

LAUNCHER_REPORTS_ENV = "SPMD_RL_LAUNCHER_REPORTS"
"""Set by the `spmd-rl` launcher: the ranks leave their closing lines to it (see `say_last`)."""

_unreported: str | None = None  # this rank's one-line message, when rank 0 is the one to print it
_closing: list[str] = []  # this rank's lines for the user at its exit (closing_message)


class UserError(Exception):
    """A problem in what the user gave us (config, data, reward function, run directory...),
    whose message names the problem and the fix."""


class ConfigError(UserError, ValueError):
    """A configuration problem, with the key at fault and how to fix it."""


def report(e: Exception, rank: int | None = None, kind: str = "error", per_rank: bool = False) -> int:
    """Print `e` as one line (only on rank 0 of a torchrun job); returns the exit code.

    `per_rank`: `e` comes from this rank's own state, not from inputs every rank reads alike (an
    out-of-memory error: each GPU's memory is its own, and rank 0 may not have it at all), so every
    rank that has it prints its line at once, naming the rank where there are several."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    global _unreported
    message = " ".join(str(e).split())
    if per_rank:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
        line = f"{kind}: " + (f"rank {rank}: " if several else "") + message
        _closing.append(line)
        print(line, file=sys.stderr, flush=True)
    elif rank == 0 or LAUNCHER_REPORTS_ENV in os.environ:
        say_last(f"{kind}: {message}", rank)
    else:
        _unreported = f"{kind}: {message}"
    return EXIT_USER_ERROR


def say_last(line: str, rank: int | None = None) -> None:
    """A line for the user at the end of the run (an error, where to resume): printed now on rank 0,
    or, under the `spmd-rl` launcher, kept for `closing_message` on every rank."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if LAUNCHER_REPORTS_ENV in os.environ:
        _closing.append(line)
    elif rank == 0:
        _closing.append(line)
        print(line, file=sys.stderr, flush=True)


def closing_message() -> str | None:
    """This rank's closing lines (`report`, `say_last`), recorded with its exit status
    (preemption.record_exit_status) for the launcher to print; None when it has none."""
    return "".join(f"{line}\n" for line in _closing) or None


def let_rank0_report_first() -> None:
    """The last thing a rank other than 0 does after a user error, once everything is torn down.

    torchrun stops every rank as soon as one exits with an error.
    When a rank other than 0 got there first, rank 0 could be killed before its line was out, and
    the run ended with exit code 2 and no message (seen in CI). Every rank reads the same inputs,
    so rank 0 hits the same error: this rank waits (SIGTERM ends it, as the launcher sends on rank
    0's exit) and prints the message itself, naming its rank, only if nobody ended it in time.
    """
    global _unreported
    if _unreported is None:
        return
    message, _unreported = _unreported, None
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun: nobody stops rank 0 early
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(RANK0_GRACE_S)
    print(f"(rank {os.environ.get('RANK', '?')}; rank 0 did not report it) {message}",
          file=sys.stderr, flush=True)

