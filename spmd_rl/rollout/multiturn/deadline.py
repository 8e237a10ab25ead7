"""Calls into user code that share one deadline (a turn's environment steps, the episodes' resets).

All calls of a batch start together in the pool and the batch takes at most `timeout` seconds,
however many of them hang: the deadline is set once, not per wait. A call that has not started by
then (queued behind hung ones) is cancelled and never runs; one still running cannot be stopped
(Python threads cannot be killed), keeps its pool thread until it returns, and its result is
dropped. A call that finished after the deadline counts as late even if it was not waited on yet.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    """What the call raised (None: it returned `value`)."""
    late: bool = False
    """Not finished by the deadline: no value, no error."""
    started: bool = True
    """False: it was still queued at the deadline and was cancelled."""


class _Timed:
    """Runs `fn` and notes when it finished."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.finished = fn, float("inf")

    def __call__(self) -> Any:
        try:
            return self.fn()
        finally:
            self.finished = time.monotonic()


def call_all(pool: Executor, fns: list[Callable[[], Any]], timeout: float | None) -> list[Outcome]:
    """Each of `fns` run in `pool`, all within `timeout` seconds from now (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    calls = [_Timed(fn) for fn in fns]
    futures = [pool.submit(c) for c in calls]
    out = []
    for call, future in zip(calls, futures):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            value, error = future.result(timeout=left), None
        except FutureTimeout:
            out.append(Outcome(late=True, started=not future.cancel()))
            continue
        except Exception as e:  # noqa: BLE001 - the user's code raised: the caller reports it
            value, error = None, e
        if deadline is not None and call.finished > deadline:
            out.append(Outcome(late=True))
        else:
            out.append(Outcome(value, error))
    return out
