"""When a generate call's requests finish: the long tail of a step's generation, measured.

A synchronous step waits for its longest response. With a long tail of response lengths the engine
spends much of the generation wall decoding a handful of sequences after most have finished
(docs/training.md, "Long-tailed response lengths"). The vLLM engine records, for each generate call,
its start, the time each request finished and its end (`GenerateTail.progress_bar`: vLLM's own
progress-bar hook, `LLM.generate(use_tqdm=...)`, which it updates as requests finish); a prompt's n
samples finish together, when the last of them does, since vLLM returns them as one output.

rollout/generate_tail_share is the share of a step's generate wall after 90% of each call's samples
had finished (summed over the step's calls: the turns of a multi-turn step, the rounds of dynamic
sampling). The partial rollouts' streamed run (spmd_rl/rollout/partial.py) has no such tail: it stops
at its cut, so it logs none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

DONE = 0.9
"""The share of a call's samples after whose finish the rest of its wall counts as the tail."""


def running_at(start: float, finishes: list[float], share: float) -> int:
    """Requests still running at `share` of the wall (start to the last finish)."""
    t = start + share * (max(finishes) - start)
    return sum(f > t for f in finishes)


def tail_seconds(finishes: list[float], end: float, done: float = DONE) -> float:
    """The wall from the finish of the ceil(done x count)-th request to `end`."""
    ordered = sorted(finishes)
    return end - ordered[max(1, math.ceil(done * len(ordered))) - 1]


def tail_share(start: float, finishes: list[float], done: float = DONE) -> float:
    """The share of the wall (start to the last finish) after `done` of the requests had finished."""
    wall = max(finishes) - start
    return tail_seconds(finishes, max(finishes), done) / wall if wall > 0 else 0.0


@dataclass
class CallTimes:
    """One generate call: its start, each sample's finish, its end (perf_counter seconds)."""

    start: float
    finishes: list[float] = field(default_factory=list)
    end: float | None = None


class GenerateTail:
    """The generate calls of a step on this engine, and their tail (the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.calls: list[CallTimes] = []

    def progress_bar(self) -> type:
        """A new call starts: the progress bar to hand to vLLM's `generate(use_tqdm=...)`. A tqdm that
        writes nowhere and records the time of each update, which vLLM makes by a finished output's
        sample count (vLLM also wraps the prompts it renders in one: iterating, a tqdm updates itself
        only once `mininterval` has passed, an hour here). `done()` ends the call."""
        from tqdm import tqdm

        call, clock = CallTimes(self.clock()), self.clock
        self.calls.append(call)

        class FinishTimes(tqdm):
            def __init__(self, *args, **kwargs):
                kwargs.update(file=_Nowhere(), mininterval=3600.0)  # no drawing, at most once an hour
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                call.finishes += [clock()] * int(n)
                return super().update(n)

        return FinishTimes

    def done(self) -> None:
        """The call that started last has returned."""
        self.calls[-1].end = self.clock()

    def metrics(self) -> dict[str, float]:
        """rollout/generate_tail_share over the calls since the last read (none: no metric), then forgets them."""
        calls = [c for c in self.calls if c.end is not None and c.finishes]
        self.calls = []
        wall = sum(c.end - c.start for c in calls)
        if not calls or wall <= 0:
            return {}
        return {"rollout/generate_tail_share": sum(tail_seconds(c.finishes, c.end) for c in calls) / wall}


class _Nowhere:
    """A file for tqdm that drops what it is given."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass
