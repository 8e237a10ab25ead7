"""Tool-call parsers: the calls an assistant turn asks for, in its chat template's format.

rollout.tool_parser picks one by name, or names your own ("module:Class"):

- "hermes" (the default): Qwen2.5's, Qwen3's and Hermes' format,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of calls per turn. Text
  inside `<think>...</think>` is reasoning, not a request: calls written there are ignored.
- "llama3_json": Llama 3.1/3.2/3.3's JSON tool calls, the whole turn one object
  `{"name": ..., "parameters": {...}}` (or several separated by ";"), possibly after `<|python_tag|>`.

A call that is not valid JSON of its format's shape becomes a `CallError`, which the model sees as
an error message.
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


class Llama3JsonParser:
    """Llama 3.x's JSON tool calls (vLLM's and verl's "llama3_json"): a turn that is a call is one
    JSON object `{"name": ..., "parameters": {...}}` ("arguments" is taken too), or several separated
    by ";", possibly after `<|python_tag|>` (the text of a special token, kept when the turn is
    decoded with it). A turn that starts otherwise is an answer. Llama's built-in tools
    (`<|python_tag|>brave_search.call(...)`) are Python, not JSON: a CallError."""

    TAG = "<|python_tag|>"
    SHAPE = 'a tool call is {"name": "<tool>", "parameters": {...}}, the whole message'

    def parse(self, text: str) -> list[ToolCall | CallError]:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        body = body[len(self.TAG):].lstrip() if tagged else body
        if not body.startswith("{"):
            return [CallError(f"<|python_tag|> must be followed by JSON: {self.SHAPE}")] if tagged else []
        calls: list[ToolCall | CallError] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                return calls + [CallError(f"the tool call is not valid JSON ({e.msg}): {self.SHAPE}")]
            calls.append(self._call(obj))
            pos = _skip(body, pos, " \t\n;")
        return calls

    def _call(self, obj: Any) -> ToolCall | CallError:
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return CallError(self.SHAPE)
        return ToolCall(obj["name"], args)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
