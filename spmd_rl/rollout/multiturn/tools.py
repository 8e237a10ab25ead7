"""Tools: plain Python functions the model calls by name (`[[rollout.tools]]`).

A tool is a function with type hints and a Google-style docstring; its JSON schema comes from
transformers' `get_json_schema` (what `apply_chat_template(tools=...)` takes). Calls run in a
thread pool, each with a timeout counted from when it starts: a tool that raises, runs past the
timeout or returns something other than a string answers the model with an error message instead,
and the error is counted. A timed-out call cannot be stopped (Python threads cannot be killed): it
keeps its pool thread until it returns, so the pool (rollout.tool_pool_size) should be larger than
the calls in flight. A call still queued behind such calls after a timeout's wait never runs: the
model is told it was not started and why.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from spmd_rl.errors import ConfigError
from spmd_rl.user_import import import_object


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict
    """{"type": "function", "function": {"name", "description", "parameters"}}."""

    @property
    def source(self) -> str:
        """Where the tool's function lives, for the log: "module:function"."""
        return f"{getattr(self.fn, '__module__', '?')}:{getattr(self.fn, '__qualname__', self.name)}"


@dataclass
class ToolResult:
    text: str
    """What the model sees: the tool's answer, or an error message."""
    error: bool = False
    fault: str = ""
    """The tool's own fault, as the metric that counts it: "tool_errors" (raised, or not a string),
    "tool_timeouts", "tool_not_started"; "" for none or the model's (an unknown tool)."""
    source: str = ""
    """The tool's function ("module:function")."""
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


@dataclass
class _Call:
    tool: Tool
    arguments: dict[str, Any]
    submitted: float
    started: threading.Event = field(default_factory=threading.Event)
    start: float = 0.0
    dropped: bool = False
    """Given up before it started: it must never run."""
    future: Future | None = None


class ToolRunner:
    """Runs tool calls in a thread pool, each with a timeout from its start, never raising."""

    def __init__(self, tools: list[Tool], timeout: float, pool_size: int):
        self.tools = {t.name: t for t in tools}
        self.timeout, self.pool_size = timeout, pool_size
        self.pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="spmd_rl-tool")
        self._lock = threading.Lock()
        self._running = 0

    def submit(self, name: str, arguments: dict[str, Any]) -> Callable[[], ToolResult]:
        """Queue one call; the returned function waits for its result: at most the timeout for it to
        start (a free pool thread), then at most the timeout for it to run."""
        tool = self.tools.get(name)
        if tool is None:
            result = ToolResult(f"error: unknown tool {name!r}; the tools are {', '.join(sorted(self.tools))}",
                                error=True)
            return lambda: result
        call = _Call(tool, arguments, time.perf_counter())
        call.future = self.pool.submit(self._run, call)
        return lambda: self._wait(call)

    def _run(self, call: _Call) -> Any:
        with self._lock:
            if call.dropped:
                return None
            call.start = time.perf_counter()
            call.started.set()
            self._running += 1
        try:
            return call.tool.fn(**call.arguments)
        finally:
            with self._lock:
                self._running -= 1

    def _wait(self, call: _Call) -> ToolResult:
        name, source = call.tool.name, call.tool.source
        if not call.started.wait(max(0.0, call.submitted + self.timeout - time.perf_counter())):
            with self._lock:
                if not call.started.is_set():  # it never runs now
                    call.dropped = True
                    return ToolResult(f"error: tool {name!r} was not started: after {self.timeout:g} s, "
                                      f"{self._running} earlier calls were still running in the "
                                      f"{self.pool_size} tool threads (rollout.tool_pool_size); this call did "
                                      "not run", error=True, fault="tool_not_started", source=source)
        left = max(0.0, call.start + self.timeout - time.perf_counter())
        try:
            value = call.future.result(timeout=left)
        except FutureTimeout:
            return ToolResult(f"error: tool {name!r} timed out after {self.timeout:g} s", error=True,
                              fault="tool_timeouts", source=source, seconds=time.perf_counter() - call.start)
        except Exception as e:  # the tool raised (wrong arguments included): the model sees why
            return ToolResult(f"error: tool {name!r} raised {type(e).__name__}: {e}", error=True,
                              fault="tool_errors", source=source, seconds=time.perf_counter() - call.start)
        seconds = time.perf_counter() - call.start
        if not isinstance(value, str):
            return ToolResult(f"error: tool {name!r} returned a {type(value).__name__}, not a string", error=True,
                              fault="tool_errors", source=source, seconds=seconds)
        return ToolResult(value, source=source, seconds=seconds)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
