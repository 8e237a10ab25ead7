"""Environments: what answers the model between its turns.

A user environment is a class named by `rollout.environment` ("package.module:Class"); one instance
per trajectory, so it keeps that trajectory's state across turns:

    class MyEnv:
        def reset(self, row: dict) -> None: ...        # the data row: prompt, ground_truth, extra_info, ...
        def step(self, message: dict) -> StepResult:   # message = {"role": "assistant", "content": text}
            return StepResult(messages=[{"role": "user", "content": "..."}], done=False, reward=None)

The row is the sample's own copy of the data row: `prompt` as the data file has it (text, or a
list of chat messages), `ground_truth`, `extra_info` (a dict), `data_source`, `index` (the row's
position in the data files), `prompt_ids` (its tokens) and `sample` (which of the prompt's
rollout.n samples this is). `messages` are chat messages appended after the model's turn (dicts
with a string "role" and a string "content", rendered with the model's chat template); `done` ends
the episode; `reward`, when given, is the trajectory's reward (a finite number; the last one given
counts) instead of the reward function's score; `metrics` are numbers summed over the trajectory
and logged as `multiturn/<key>_mean`. spmd_rl/envs/hidden_digit.py is an example.

An environment that raises, runs past rollout.tool_timeout or returns a bad value (not a
StepResult, a reward that is not a finite number, a message that is not a chat message) ends its
own trajectory ("env_error" / "env_timeout"), counted and logged once (faults.py); a metric that
is not a finite number is dropped, counted the same way.

Tools (`[[rollout.tools]]`) are the environment `ToolEnvironment`: it runs the calls of a turn and
answers with one "tool" message per call; a turn without a call ends the episode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from spmd_rl.rollout.multiturn.faults import FAULT_METRICS, FaultLog
from spmd_rl.rollout.multiturn.parsers import CallError, ToolCallParser
from spmd_rl.rollout.multiturn.tools import ToolResult, ToolRunner


@dataclass
class StepResult:
    messages: list[dict[str, Any]]
    """Chat messages that follow the model's turn (role "tool", "user", ...)."""
    done: bool
    """The episode is over: the model gets no further turn."""
    reward: float | None = None
    """The trajectory's reward, when the environment decides it."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers of this step, summed over the trajectory (tool calls, errors, ...): `multiturn/<key>_mean`."""


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode for this data row."""

    def step(self, message: dict[str, Any]) -> StepResult:
        """React to the model's turn (an assistant message)."""


class BadStepResult(ValueError):
    """A step returned what the loop cannot use; the message names the environment and the field."""


RESERVED_METRICS = ("turns", "trajectories") + FAULT_METRICS
"""Names the loop's own multiturn/* metrics use: an environment's metric may not take them."""


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (int, float, bool, numpy or one-element
    tensor scalars; not a string), else None."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # a tensor of several elements, ...
        return None
    return number if math.isfinite(number) else None


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def check_step_result(result: Any, source: str) -> tuple[StepResult, list[str]]:
    """`result` if the loop can use it, with only its finite numeric metrics under free names, and
    a message for each metric dropped. Raises BadStepResult, naming `source` (the environment) and
    the field, for a result that is not a StepResult or has a bad `messages`, `done` or `reward`."""
    def bad(what: str) -> str:
        return f"{source}.step returned {what}"[:500]

    if not isinstance(result, StepResult):
        raise BadStepResult(bad(f"a {type(result).__name__} ({result!r:.100}), not a StepResult"))
    if not isinstance(result.messages, list):
        raise BadStepResult(bad(f"StepResult.messages = {result.messages!r:.100}, not a list of chat messages"))
    for i, m in enumerate(result.messages):
        if not _is_message(m):
            raise BadStepResult(bad(f"StepResult.messages[{i}] = {m!r:.100}: a chat message is a dict with a "
                                    "string 'role' and a string 'content'"))
    if not (isinstance(result.done, bool) or type(result.done).__name__ == "bool_"):  # numpy's too
        raise BadStepResult(bad(f"StepResult.done = {result.done!r:.100}, not a bool"))
    reward = None if result.reward is None else finite_number(result.reward)
    if result.reward is not None and reward is None:
        raise BadStepResult(bad(f"StepResult.reward = {result.reward!r:.100}, not a finite number (or None)"))
    metrics, dropped = _check_metrics(result.metrics, source)
    return StepResult(result.messages, bool(result.done), reward, metrics), dropped


def _check_metrics(metrics: Any, source: str) -> tuple[dict[str, float], list[str]]:
    if not isinstance(metrics, dict):
        return {}, [f"{source}.step returned StepResult.metrics = {metrics!r:.100}, not a dict of numbers"]
    kept, dropped = {}, []
    for key, value in metrics.items():
        number = finite_number(value)
        if not isinstance(key, str) or key in RESERVED_METRICS:
            dropped.append(f"{source}.step returned StepResult.metrics key {key!r:.100}: a metric's name is a string "
                           f"other than {', '.join(RESERVED_METRICS)}")
        elif number is None:
            dropped.append(f"{source}.step returned StepResult.metrics[{key!r}] = {value!r:.100}, not a finite number")
        else:
            kept[key] = number
    return kept, dropped


TOOL_METRICS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_not_started", "tool_seconds")


class ToolEnvironment:
    """The model calls tools: each turn's calls run (in parallel, each with its timeout) and their
    answers come back as tool messages; a turn without calls is the final answer."""

    def __init__(self, runner: ToolRunner, parser: ToolCallParser, faults: FaultLog):
        self.runner, self.parser, self.faults = runner, parser, faults
        self.row: int | None = None

    def reset(self, row: dict[str, Any]) -> None:
        self.row = row.get("index")

    def step(self, message: dict[str, Any]) -> StepResult:
        calls = self.parser.parse(message["content"])
        if not calls:
            return StepResult([], done=True)
        waits = [(lambda c=c: ToolResult(f"error: {c.message}", error=True)) if isinstance(c, CallError)
                 else self.runner.submit(c.name, c.arguments) for c in calls]
        results = [wait() for wait in waits]
        for r in results:
            if r.fault:  # the tool's own fault, not the model's (an unknown tool, a malformed call)
                self.faults.report(r.fault, f"tool {r.source}", self.row, r.text.removeprefix("error: "))
        metrics = {"tool_calls": float(len(results)), "tool_errors": float(sum(r.error for r in results)),
                   "tool_timeouts": float(sum(r.fault == "tool_timeouts" for r in results)),
                   "tool_not_started": float(sum(r.fault == "tool_not_started" for r in results)),
                   "tool_seconds": sum(r.seconds for r in results)}
        return StepResult([{"role": "tool", "content": r.text} for r in results], done=False, metrics=metrics)
