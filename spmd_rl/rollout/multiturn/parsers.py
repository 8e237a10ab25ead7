"""Tool-call parsers: the calls an assistant turn asks for, in its chat template's format.

The default reads Qwen2.5's (and Hermes') format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of calls per turn. Text inside `<think>...</think>` is reasoning, not a request: calls
written there are ignored. A call that is not valid JSON of that shape becomes a `CallError`, which
the model sees as an error message (rollout.tool_parser names another parser, "module:Class").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class CallError:
    """A call the parser could not read; `message` tells the model what was wrong."""

    message: str


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall | CallError]:
        """The calls in one assistant turn's text, in order; [] when it calls no tool."""


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (Qwen2.5, Hermes, verl's format = "hermes")."""

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | CallError]:
        text = self.THINK.sub("", text)
        calls: list[ToolCall | CallError] = [self._call(m.group(1)) for m in self.CALL.finditer(text)]
        rest = self.CALL.sub("", text)
        if "<tool_call>" in rest:
            calls.append(CallError("a <tool_call> was not closed by </tool_call>"))
        return calls

    @staticmethod
    def _call(body: str) -> ToolCall | CallError:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return CallError(f"the tool call is not valid JSON ({e.msg}): write "
                             '{"name": "<tool>", "arguments": {...}} inside <tool_call></tool_call>')
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return CallError('a tool call must be {"name": "<tool>", "arguments": {...}}')
        return ToolCall(obj["name"], args)


PARSERS = {"hermes": HermesParser}
