"""What the Python sandbox costs and how fast it enforces its limits, against a bare process in the
same run.

    python -m steprl_jax.benchmarks.sandbox [--calls 20] [--json PATH]

* per call: `tools.python_sandbox.run_python` (the strongest isolation this host allows, see
  `isolation()`) against the reference at its best, an unsandboxed `python -I -c CODE` child
  (`subprocess.run`, output captured), on the same small snippet, one call after the other; the
  medians and their ratio (sandbox / bare: what the isolation adds to a tool call).
* enforcement: how long a CPU loop takes to be stopped by a 1 s CPU limit, and how far past a 2 s
  wall deadline a sleeping snippet ends (the deadline's overshoot), each the median of 3.

The tests check what the sandbox decides (status, error line); the times live here.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time

import numpy as np

from steprl_jax.tools.python_sandbox import SandboxSettings, isolation, run_python

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
    out = {
        "machine": platform.processor() or platform.machine(), "isolation": isolation(settings).describe(),
        "calls": args.calls, "bare_s": float(np.median(bare)), "sandbox_s": float(np.median(sandboxed)),
        "ratio_sandbox_over_bare": float(np.median(sandboxed) / np.median(bare)),
        "cpu_limit_1s_stopped_after_s": float(np.median(cpu_stop)),
        "wall_deadline_2s_overshoot_s": float(np.median(overshoot)),
    }
    print(f"isolation: {out['isolation']}")
    print(f"per call (median of {args.calls}): bare python {out['bare_s'] * 1e3:.0f} ms, sandbox "
          f"{out['sandbox_s'] * 1e3:.0f} ms, ratio sandbox / bare {out['ratio_sandbox_over_bare']:.2f}")
    print(f"a CPU loop under a 1 s CPU limit stopped after {out['cpu_limit_1s_stopped_after_s']:.2f} s; "
          f"a 2 s wall deadline overshot by {out['wall_deadline_2s_overshoot_s']:.2f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
