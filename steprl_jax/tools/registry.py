"""A registry of tools that executes a list of calls concurrently, each under a time limit.

Results come back in call order. Nothing an agent writes can make `execute` raise: an
unknown tool, arguments that are not an object, a tool that hangs or crashes all become
typed error results.

Each call runs on its own daemon thread. Python cannot kill a thread, so a call that exceeds its
limit is abandoned: it gets a `timeout` result at once and its thread finishes (or not) in the
background, without holding one of the `max_workers` slots and without keeping the process from
exiting. (A fixed pool would do neither: after `max_workers` hung calls every later call would
wait behind them and time out without having run, and the interpreter would wait for the hung
threads at exit.) So that a tool that hangs for good does not leak a thread per call for a whole
run, the registry counts, per tool, the abandoned calls whose threads are still alive
(`hung_calls`); once a tool has `max_hung` of them, its further calls get a `timeout` result at
once, without a thread, until some of the hung ones return.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
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
    """Tools by name, run side by side: at most `max_workers` calls at once (a call that timed
    out no longer counts), each under its tool's time limit (`default_timeout_s` when unset).
    A tool with `max_hung` (default: `max_workers`) timed-out calls still running is not started
    again until one of them returns: its calls are answered with a `timeout` result at once."""

    def __init__(self, tools: Iterable[Tool] = (), default_timeout_s: float = 10.0, max_workers: int = 16,
                 max_hung: int | None = None):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_hung is not None and max_hung < 0:
            raise ValueError(f"max_hung must be >= 0, got {max_hung}")
        self._tools: dict[str, Tool] = {}
        self.default_timeout_s = default_timeout_s
        self.max_workers = max_workers
        self.max_hung = max_workers if max_hung is None else max_hung
        self._slots = threading.Semaphore(max_workers)
        self._hung_lock = threading.Lock()
        self._hung: dict[str, int] = {}  # tool name -> abandoned calls whose threads are still alive
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

    @property
    def hung_calls(self) -> dict[str, int]:
        """Per tool, the calls that timed out and whose threads have not returned yet (tools with none
        are left out)."""
        with self._hung_lock:
            return {name: count for name, count in self._hung.items() if count}

    def _hung_add(self, name: str, delta: int) -> None:
        with self._hung_lock:
            self._hung[name] = self._hung.get(name, 0) + delta

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
            with self._hung_lock:
                hung = self._hung.get(tool.name, 0)
            if hung >= self.max_hung:  # never start another thread for a tool that hangs for good
                results[index] = error_result(
                    tool.name, TIMEOUT,
                    f"not run: too many calls of this tool are still hung ({hung} timed out and have "
                    f"not returned; at most {self.max_hung})")
                continue
            pending.append((index, self._start(tool, call.arguments), limit))
        started = time.monotonic()
        for index, running, limit in pending:
            name = as_tool_call(calls[index]).name
            # All calls started together, so each waits only for what is left of its own limit.
            remaining = max(0.0, limit - (time.monotonic() - started))
            try:
                results[index] = running.future.result(timeout=remaining)
            except concurrent.futures.TimeoutError:
                running.abandon()
                results[index] = error_result(name, TIMEOUT, f"the call did not finish within {limit:g} s")
            except Exception as err:  # Tool.__call__ already catches; this guards the worker itself
                results[index] = error_result(name, TOOL_FAILURE, f"{type(err).__name__}: {err}")
        return results  # type: ignore[return-value]

    def _start(self, tool: Tool, arguments: Any) -> "_Running":
        running = _Running(self._slots, lambda delta, name=tool.name: self._hung_add(name, delta))
        threading.Thread(target=running.work, args=(tool, arguments), name=f"tool-{tool.name[:_MAX_NAME_ECHO]}",
                         daemon=True).start()
        return running

    def close(self) -> None:
        """Nothing to release: abandoned calls finish on their own daemon threads."""


class _Running:
    """One call on its own thread: it takes a slot before the tool runs and gives it back when the
    tool returns or when `execute` abandons the call (its time is up), whichever comes first. An
    abandoned call whose thread is still alive counts as hung (`count_hung(+1)`) until the thread
    ends (`count_hung(-1)`)."""

    def __init__(self, slots: threading.Semaphore, count_hung):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._slots = slots
        self._count_hung = count_hung
        self._lock = threading.Lock()
        self._holds_slot = False
        self._abandoned = False
        self._ended = False
        self._counted = False

    def work(self, tool: Tool, arguments: Any) -> None:
        try:
            self._work(tool, arguments)
        finally:
            with self._lock:
                self._ended = True
                if self._counted:
                    self._counted = False
                    self._count_hung(-1)

    def _work(self, tool: Tool, arguments: Any) -> None:
        self._slots.acquire()
        with self._lock:
            if self._abandoned:  # its time ran out while it waited for a slot: never run it
                self._slots.release()
                return
            self._holds_slot = True
        try:
            result = tool(arguments)
        except BaseException as err:  # Tool.__call__ catches Exception; keep the thread's end tidy anyway
            self._free()
            self.future.set_exception(err)
            return
        self._free()
        self.future.set_result(result)

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if not self._ended and not self._counted:
                self._counted = True
                self._count_hung(+1)
        self._free()

    def _free(self) -> None:
        with self._lock:
            held, self._holds_slot = self._holds_slot, False
        if held:
            self._slots.release()
