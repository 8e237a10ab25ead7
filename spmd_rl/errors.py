"""Errors a user can fix, and how the entry points report them.

Every exception that means "your input is wrong" (config, data, reward function, run directory,
checkpoint, export) derives from `UserError`. The entry points catch it and print its message
as one line on rank 0 and exit with `EXIT_USER_ERROR`, instead of a traceback per rank: the
message itself names the problem and the fix.
"""

from __future__ import annotations

import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem in what the user gave us (config, data, reward function, run directory...),
    whose message names the problem and the fix."""


def report(e: UserError, rank: int | None = None) -> int:
    """Print `e` as one line (only on rank 0 of a torchrun job); returns the exit code."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
