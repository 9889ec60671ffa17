"""A registry of tools that executes a list of calls concurrently, each under a time limit.

Results come back in call order. Nothing an agent writes can make `execute` raise: an
unknown tool, arguments that are not an object, a tool that hangs or crashes all become
typed error results.
"""
from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any, Iterable, Mapping, Sequence

from steprl_jax.tools.protocol import (
    MALFORMED_ARGUMENTS,
    TIMEOUT,
    TOOL_FAILURE,
    UNKNOWN_TOOL,
    Tool,
    ToolCall,
    ToolResult,
    error_result,
)

_MAX_NAME_ECHO = 60


def as_tool_call(call: Any) -> ToolCall | ToolResult:
    """Normalise a `ToolCall`, a `{"name", "arguments"}` dict (arguments may be a JSON string)
    or anything else into a `ToolCall`, or an error result saying why it is not one."""
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        return error_result("?", MALFORMED_ARGUMENTS, 'a call must be an object {"name": str, "arguments": object}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI transports arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as err:
            return error_result(call["name"], MALFORMED_ARGUMENTS, f"arguments are not valid JSON: {err}")
    return ToolCall(name=call["name"], arguments=arguments)


class ToolRegistry:
    """Tools by name, plus a thread pool to run calls side by side.

    A call that exceeds its time limit returns a `timeout` result; Python cannot kill a
    thread, so the worker finishes in the background (tools here are bounded, in memory).
    """

    def __init__(self, tools: Iterable[Tool] = (), default_timeout_s: float = 10.0, max_workers: int = 16):
        self._tools: dict[str, Tool] = {}
        self.default_timeout_s = default_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tool")
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def tools(self) -> list[Tool]:
        return list(self._tools.values())

    def openai_schemas(self) -> list[dict]:
        """All tools in the form chat templates take as `tools=`."""
        return [tool.openai_schema for tool in self._tools.values()]

    def validation_error(self, call: Any) -> str | None:
        """Why a call would be rejected before running (unknown tool or bad arguments), else None."""
        normal = as_tool_call(call)
        if isinstance(normal, ToolResult):
            return normal.message
        if normal.name not in self._tools:
            return f"unknown tool {normal.name[:_MAX_NAME_ECHO]!r}"
        return self._tools[normal.name].validation_error(normal.arguments)

    def execute_one(self, call: Any) -> ToolResult:
        return self.execute([call])[0]

    def execute(self, calls: Sequence[Any]) -> list[ToolResult]:
        """Run all calls concurrently; one result per call, in call order."""
        pending: list[tuple[int, concurrent.futures.Future, float]] = []
        results: list[ToolResult | None] = [None] * len(calls)
        for index, raw in enumerate(calls):
            call = as_tool_call(raw)
            if isinstance(call, ToolResult):
                results[index] = call
                continue
            tool = self._tools.get(call.name)
            if tool is None:
                known = ", ".join(sorted(self._tools))
                results[index] = error_result(
                    call.name[:_MAX_NAME_ECHO], UNKNOWN_TOOL,
                    f"no tool named {call.name[:_MAX_NAME_ECHO]!r}; available tools: {known}")
                continue
            limit = tool.timeout_s if tool.timeout_s is not None else self.default_timeout_s
            pending.append((index, self._pool.submit(tool, call.arguments), limit))
        started = time.monotonic()
        for index, future, limit in pending:
            name = as_tool_call(calls[index]).name
            # All calls started together, so each waits only for what is left of its own limit.
            remaining = max(0.0, limit - (time.monotonic() - started))
            try:
                results[index] = future.result(timeout=remaining)
            except concurrent.futures.TimeoutError:
                future.cancel()
                results[index] = error_result(name, TIMEOUT, f"the call did not finish within {limit:g} s")
            except Exception as err:  # Tool.__call__ already catches; this guards the pool itself
                results[index] = error_result(name, TOOL_FAILURE, f"{type(err).__name__}: {err}")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
