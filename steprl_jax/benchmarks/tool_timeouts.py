"""How long a batch of tool calls with hung ones takes in the tool registry, against its time limit
and against a bare thread pool waiting for the same calls, in the same run.

    python -m steprl_jax.benchmarks.tool_timeouts [--calls 16] [--hung 4] [--limit 0.5] [--repeats 5] [--json PATH]

Per repeat, `calls` calls of which `hung` never return by themselves (they wait on an event set
once the repeat is measured): the wall time of `ToolRegistry.execute` (each call on its own
thread, every call under its tool's limit, the hung ones abandoned with a `timeout` result)
against the reference at its best, `concurrent.futures.wait(..., timeout=limit)` on a fresh
`ThreadPoolExecutor` of `calls` workers (which answers nothing for the hung calls and leaves its
workers to them). The medians, ours / bare, and ours / limit (1.0: a batch with a hung call costs
its limit and nothing more). The tests check what the registry answers (a `timeout` result per
hung call, a run that never waits for one: tests/test_faults_tools.py); the times live here.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import threading
import time

import numpy as np

from steprl_jax.tools.protocol import TIMEOUT, Tool, object_schema
from steprl_jax.tools.registry import ToolRegistry


def _tools(release: threading.Event, limit: float) -> list[Tool]:
    def hang() -> str:
        release.wait()
        return "too late"

    return [Tool("hang", "never returns by itself", object_schema({}), hang, timeout_s=limit),
            Tool("echo", "answers at once", object_schema({"x": {"type": "integer"}}), lambda x: str(x),
                 timeout_s=limit)]


def _batch(calls: int, hung: int) -> list[dict]:
    return [{"name": "hang", "arguments": {}} if i < hung else {"name": "echo", "arguments": {"x": i}}
            for i in range(calls)]


def _ours(calls: int, hung: int, limit: float) -> float:
    release = threading.Event()
    registry = ToolRegistry(_tools(release, limit), max_workers=calls)
    start = time.perf_counter()
    results = registry.execute(_batch(calls, hung))
    seconds = time.perf_counter() - start
    release.set()
    kinds = [r.error_type if not r.ok else "ok" for r in results]
    assert kinds == [TIMEOUT] * hung + ["ok"] * (calls - hung), kinds
    return seconds


def _bare(calls: int, hung: int, limit: float) -> float:
    release = threading.Event()
    tools = {tool.name: tool for tool in _tools(release, limit)}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=calls)
    start = time.perf_counter()
    futures = [pool.submit(tools[c["name"]], c["arguments"]) for c in _batch(calls, hung)]
    done, not_done = concurrent.futures.wait(futures, timeout=limit)
    seconds = time.perf_counter() - start
    release.set()
    pool.shutdown(wait=True)
    assert len(not_done) == hung, (len(done), len(not_done))
    return seconds


def measure(calls: int, hung: int, limit: float, repeats: int) -> dict:
    if not 0 < hung < calls:
        raise ValueError(f"--hung must be between 1 and --calls - 1 ({calls - 1}), got {hung}")
    rows = [{"ours_s": _ours(calls, hung, limit), "bare_s": _bare(calls, hung, limit)} for _ in range(repeats)]
    ours, bare = (float(np.median([r[k] for r in rows])) for k in ("ours_s", "bare_s"))
    return {"calls": calls, "hung": hung, "limit_s": limit, "rows": rows, "ours_s": ours, "bare_s": bare,
            "ours_over_bare": ours / bare, "ours_over_limit": ours / limit}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--hung", type=int, default=4)
    p.add_argument("--limit", type=float, default=0.5, help="each tool's time limit, seconds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.limit <= 0 or a.repeats < 1:
        p.error("--limit must be > 0 and --repeats >= 1")
    try:
        out = measure(a.calls, a.hung, a.limit, a.repeats)
    except ValueError as err:
        p.error(str(err))
    print(f"{a.calls} calls, {a.hung} hung, limit {a.limit:g} s, median of {a.repeats}:")
    print(f"  registry {out['ours_s']:.3f} s   bare thread pool {out['bare_s']:.3f} s   "
          f"registry / bare {out['ours_over_bare']:.3f}   registry / limit {out['ours_over_limit']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
