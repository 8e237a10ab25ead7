"""Faults of user code in a multi-turn run: what a tool or an environment did wrong, logged once.

A tool or environment that raises, hangs or returns a bad value costs its own trajectory (it ends,
or the model sees an error), never the run. Each fault is counted per trajectory (the
`multiturn/<kind>_mean` metrics: FAULT_METRICS here, the tool_* counts for tools) and the first
one of each kind is logged with who did it (the environment class or the tool), what happened and
the data row; later ones of that kind are only counted, so a broken environment does not print a
line per trajectory.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("spmd_rl")

FAULT_METRICS = ("reset_errors", "step_errors", "step_timeouts", "bad_values", "special_text")
"""Per trajectory: environments that failed to start (construction or reset raised or timed out),
steps that raised, steps past the turn's deadline, values refused (a step result, reward, message
or metric of the wrong type, or not finite), special-token texts in tool or environment messages."""

OUTCOMES = {
    "reset_errors": "its trajectory ends after the model's first turn",
    "step_errors": "its trajectory ends",
    "step_timeouts": "its trajectory ends (a running step cannot be stopped: it holds one of the "
                     "rollout.tool_pool_size threads until it returns)",
    "bad_values": "refused: a bad metric is dropped, any other bad value ends its trajectory",
    "special_text": "it is tokenized as plain text, never as control tokens",
    "tool_errors": "the model sees the error",
    "tool_timeouts": "the model sees the error (a running call cannot be stopped: it holds one of the "
                     "rollout.tool_pool_size threads until it returns)",
    "tool_not_started": "the model sees the error; the call never runs",
}
"""What the loop does about each kind of fault (the tool_* kinds are ToolEnvironment's metrics)."""


class FaultLog:
    """Logs the first fault of each kind (thread-safe: tools report from their pool's threads)."""

    def __init__(self):
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def report(self, kind: str, source: str, row: int | None, detail: str) -> None:
        """`kind`: the metric that counts it (an OUTCOMES key); `source`: the environment class or
        tool; `row`: the data row's index; `detail`: what happened (the exception, the value refused)."""
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning("multi-turn: %s (data row %s): %s; %s. Counted in multiturn/%s_mean; later ones are not logged",
                    source, row, detail, OUTCOMES[kind], kind)
