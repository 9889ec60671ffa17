"""What the Python sandbox costs and how fast it enforces its limits, against a bare process in the
same run.

    python -m steprl_jax.benchmarks.sandbox [--calls 20] [--json PATH]

* per call: `tools.python_sandbox.run_python` (the strongest isolation this host allows, see
  `isolation()`) against the reference at its best, an unsandboxed `python -I -c CODE` child
  (`subprocess.run`, output captured), on the same small snippet, one call after the other; the
  medians and their ratio (sandbox / bare: what the isolation adds to a tool call).
* enforcement: how long a CPU loop takes to be stopped by a 1 s CPU limit, and how far past a 2 s
  wall deadline a sleeping snippet ends (the deadline's overshoot), each the median of 3.
* a killed caller: a child process starts a sleeping snippet under a 1 s deadline and is SIGKILLed;
  nobody is left to enforce the deadline but the sandbox's outer `timeout` (deadline + grace). How
  long the orphaned sandbox's processes live from their start, against that bound (median of 3).

The tests check what the sandbox decides (status, error line); the times live here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from steprl_jax.tools.python_sandbox import _OUTER_GRACE_S, SandboxSettings, isolation, run_python

SNIPPET = "import math\nprint(sum(math.sqrt(i) for i in range(1000)))"


def _bare(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, timeout=60, check=True)
    return time.perf_counter() - start


def _sandboxed(code: str, settings: SandboxSettings) -> float:
    result = run_python(code, settings)
    if result.status != "ok":
        raise RuntimeError(f"the sandbox failed the benchmark snippet: {result}")
    return result.duration_s


def _enforced(code: str, settings: SandboxSettings, status: str) -> float:
    result = run_python(code, settings)
    if result.status != status:
        raise RuntimeError(f"expected status {status!r}, got {result}")
    return result.duration_s


def _living_processes() -> dict:
    """pid -> parent pid of every process not yet exited (zombies count as exited)."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    return parents


def _descendants(pid: int) -> set:
    parents = _living_processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


ORPHAN_CALLER = ("import sys\nfrom steprl_jax.tools.python_sandbox import SandboxSettings, isolation, run_python\n"
                 "settings = SandboxSettings(wall_timeout_s=float(sys.argv[1]))\n"
                 "isolation(settings)\nprint('probed', flush=True)\n"
                 "run_python('import time; time.sleep(1000)', settings)")


def _orphan_lifetime(deadline_s: float) -> float:
    """Seconds from an orphaned sandbox's start to the exit of its last process."""
    scratch = tempfile.mkdtemp(prefix="sandbox_bench_")
    os.chmod(scratch, 0o711)  # the uid-drop mode works in a folder under it
    caller = subprocess.Popen([sys.executable, "-c", ORPHAN_CALLER, f"{deadline_s:g}"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "TMPDIR": scratch})
    try:
        if caller.stdout.readline() != "probed\n":
            raise RuntimeError("the caller failed before starting its sandbox")
        started, sandbox = None, set()
        limit = time.monotonic() + 30.0
        while time.monotonic() < limit:
            sandbox = _descendants(caller.pid)
            if sandbox and started is None:
                started = time.monotonic()
            if started is not None and time.monotonic() - started > 0.3:  # the whole chain has spawned
                break
            time.sleep(0.01)
        if started is None:
            raise RuntimeError("the sandbox never started")
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()
    limit = time.monotonic() + 120.0  # guards against a sandbox that never ends (it would sleep 1000 s)
    while sandbox & set(_living_processes()):
        if time.monotonic() > limit:
            raise RuntimeError(f"the orphaned sandbox outlived its caller by 120 s: pids {sorted(sandbox)}")
        time.sleep(0.01)
    lifetime = time.monotonic() - started
    shutil.rmtree(scratch, ignore_errors=True)
    return lifetime


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per side (after one warm-up each)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    settings = SandboxSettings()
    _bare(SNIPPET), _sandboxed(SNIPPET, settings)  # warm-up: page cache, the isolation probe
    bare, sandboxed = [], []
    for _ in range(args.calls):  # interleaved: both sides see the same machine load
        bare.append(_bare(SNIPPET))
        sandboxed.append(_sandboxed(SNIPPET, settings))
    cpu_limited = dataclasses.replace(settings, cpu_s=1, wall_timeout_s=10.0)
    cpu_stop = [_enforced("while True:\n    pass", cpu_limited, "limit") for _ in range(3)]
    deadline = dataclasses.replace(settings, wall_timeout_s=2.0)
    overshoot = [_enforced("import time\ntime.sleep(1000)", deadline, "timeout") - 2.0 for _ in range(3)]
    orphaned = [_orphan_lifetime(1.0) for _ in range(3)]
    out = {
        "machine": platform.processor() or platform.machine(), "isolation": isolation(settings).describe(),
        "calls": args.calls, "bare_s": float(np.median(bare)), "sandbox_s": float(np.median(sandboxed)),
        "ratio_sandbox_over_bare": float(np.median(sandboxed) / np.median(bare)),
        "cpu_limit_1s_stopped_after_s": float(np.median(cpu_stop)),
        "wall_deadline_2s_overshoot_s": float(np.median(overshoot)),
        "orphan_deadline_1s_bound_s": 1.0 + _OUTER_GRACE_S, "orphan_lifetime_s": float(np.median(orphaned)),
        "ratio_orphan_lifetime_over_bound": float(np.median(orphaned) / (1.0 + _OUTER_GRACE_S)),
    }
    print(f"isolation: {out['isolation']}")
    print(f"per call (median of {args.calls}): bare python {out['bare_s'] * 1e3:.0f} ms, sandbox "
          f"{out['sandbox_s'] * 1e3:.0f} ms, ratio sandbox / bare {out['ratio_sandbox_over_bare']:.2f}")
    print(f"a CPU loop under a 1 s CPU limit stopped after {out['cpu_limit_1s_stopped_after_s']:.2f} s; "
          f"a 2 s wall deadline overshot by {out['wall_deadline_2s_overshoot_s']:.2f} s")
    print(f"a sandbox whose caller was SIGKILLed (1 s deadline) ended {out['orphan_lifetime_s']:.2f} s after it "
          f"started: {out['ratio_orphan_lifetime_over_bound']:.2f} x its outer bound of "
          f"{out['orphan_deadline_1s_bound_s']:g} s (deadline + grace)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
