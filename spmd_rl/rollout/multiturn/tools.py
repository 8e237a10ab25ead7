"""Tools: plain Python functions the model calls by name (`[[rollout.tools]]`).

A tool is a function with type hints and a Google-style docstring; its JSON schema comes from
transformers' `get_json_schema` (what `apply_chat_template(tools=...)` takes). Calls run in a
thread pool, each with a timeout: a tool that raises, runs past the timeout or returns something
other than a string answers the model with an error message instead, and the error is counted.
A timed-out call cannot be stopped (Python threads cannot be killed): it keeps its pool thread
until it returns, so the pool (rollout.tool_pool_size) should be larger than the calls in flight.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from spmd_rl.errors import ConfigError
from spmd_rl.user_import import import_object


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict
    """{"type": "function", "function": {"name", "description", "parameters"}}."""


@dataclass
class ToolResult:
    text: str
    """What the model sees: the tool's answer, or an error message."""
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0


def tool_schema(fn: Callable, key: str) -> dict:
    """The function's JSON schema, or a ConfigError naming `key` when transformers cannot build one
    (missing type hints or docstring, an argument the docstring does not describe)."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ConfigError(f"{key}: {getattr(fn, '__name__', fn)!r} has no usable schema ({e}); give every "
                          "argument a type hint and a Google-style docstring with an Args: section") from None


def load_tools(entries: list[dict[str, Any]]) -> list[Tool]:
    """The tools of `rollout.tools` entries ({function = "module:function"}), checked: importable,
    a schema, unique names."""
    tools: list[Tool] = []
    for i, entry in enumerate(entries):
        key = f"rollout.tools[{i}]"
        if set(entry) != {"function"} or not isinstance(entry["function"], str):
            raise ConfigError(f"{key} = {entry!r}: each [[rollout.tools]] entry is one key, "
                              'function = "package.module:function"')
        fn = import_object(entry["function"], f"{key}.function", ConfigError)
        schema = tool_schema(fn, f"{key}.function = {entry['function']!r}")
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise ConfigError(f"{key}: two tools are named {name!r}; tool names must be unique")
        tools.append(Tool(name, fn, schema))
    return tools


class ToolRunner:
    """Runs tool calls in a thread pool with a per-call timeout, never raising."""

    def __init__(self, tools: list[Tool], timeout: float, pool_size: int):
        self.tools = {t.name: t for t in tools}
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="spmd_rl-tool")

    def submit(self, name: str, arguments: dict[str, Any]) -> Callable[[], ToolResult]:
        """Start one call; the returned function waits for its result (at most the timeout)."""
        tool = self.tools.get(name)
        if tool is None:
            result = ToolResult(f"error: unknown tool {name!r}; the tools are {', '.join(sorted(self.tools))}",
                                error=True)
            return lambda: result
        start = time.perf_counter()
        future: Future = self.pool.submit(tool.fn, **arguments)
        return lambda: self._wait(name, future, start)

    def _wait(self, name: str, future: Future, start: float) -> ToolResult:
        left = max(0.0, self.timeout - (time.perf_counter() - start))
        try:
            value = future.result(timeout=left)
        except FutureTimeout:
            return ToolResult(f"error: tool {name!r} timed out after {self.timeout:g} s", error=True, timeout=True,
                              seconds=time.perf_counter() - start)
        except Exception as e:  # the tool raised (wrong arguments included): the model sees why
            return ToolResult(f"error: tool {name!r} raised {type(e).__name__}: {e}", error=True,
                              seconds=time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if not isinstance(value, str):
            return ToolResult(f"error: tool {name!r} returned a {type(value).__name__}, not a string", error=True,
                              seconds=seconds)
        return ToolResult(value, seconds=seconds)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
