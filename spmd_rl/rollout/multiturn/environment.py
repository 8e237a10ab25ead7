"""Environments: what answers the model between its turns.

A user environment is a class named by `rollout.environment` ("package.module:Class"); one instance
per trajectory, so it keeps that trajectory's state across turns:

    class MyEnv:
        def reset(self, row: dict) -> None: ...        # the data row: prompt, ground_truth, extra_info, ...
        def step(self, message: dict) -> StepResult:   # message = {"role": "assistant", "content": text}
            return StepResult(messages=[{"role": "user", "content": "..."}], done=False, reward=None)

`messages` are chat messages appended after the model's turn (rendered with the model's chat
template); `done` ends the episode; `reward`, when given, is the trajectory's reward (the last one
given counts) instead of the reward function's score. spmd_rl/envs/hidden_digit.py is an example.

Tools (`[[rollout.tools]]`) are the environment `ToolEnvironment`: it runs the calls of a turn and
answers with one "tool" message per call; a turn without a call ends the episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from spmd_rl.rollout.multiturn.faults import FaultLog
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
    """Counts of this step, summed over the trajectory (tool calls, errors, ...)."""


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode for this data row."""

    def step(self, message: dict[str, Any]) -> StepResult:
        """React to the model's turn (an assistant message)."""


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
