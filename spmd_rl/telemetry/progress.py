"""Time left in a run, for the step line: the mean wall time of the last WINDOW steps, measured from
the end of one step to the end of the next (so a step's validation, logging and checkpoint stall
count), times the steps left."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

WINDOW = 10
"""Steps whose mean time predicts the rest: recent enough to follow a change of pace, enough to
smooth one slow step (the first, which compiles; one that validates or saves)."""


class StepClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.last: float | None = None
        self.times: deque[float] = deque(maxlen=WINDOW)

    def start(self) -> None:
        """Before the first step of this process."""
        self.last = self.clock()

    def tick(self) -> None:
        """At the end of each step."""
        now = self.clock()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def pace(self, step: int, total: int) -> str:
        """"1.2 s/step, ~59 s left" after step `step` of `total` ("" before the first tick; no time
        left after the last step)."""
        if not self.times:
            return ""
        mean = sum(self.times) / len(self.times)
        left = max(total - step, 0) * mean
        return f"{mean:.3g} s/step" + (f", ~{duration(left)} left" if left else "")


def duration(seconds: float) -> str:
    """'59 s', '12 min', '3.4 h': seconds (rounded up) under 100 s, minutes under 100 min, else hours."""
    if seconds < 100:
        return f"{math.ceil(seconds)} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
