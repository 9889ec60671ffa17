"""Where a jitted step's time goes: one call traced with `jax.profiler`, its XLA ops grouped.

    rows, wall_s = profile_call(step, state, batch)   # one extra call, traced
    print(format_rows(rows, wall_s))

Every op XLA runs (a "thunk": a fusion, a dot, a copy) is one event in the trace. Its exclusive
time (minus the ops nested in it, such as a loop's body) is summed by kind:

- matmuls, by the element type of their operands (`bf16`, `f32`, `mixed`), with the FLOPs
  read from the compiled program, so the achieved rate sits next to the host's matmul rate;
- every other op by the name XLA gives its kind (`convert_bitcast_fusion`, `wrapped_broadcast`...).

Times are thread-seconds: XLA:CPU may run two independent ops at once, so they can add up to
more than the wall time. A dot that XLA hands to a thread pool without waiting for it is timed
at its launch only; the table counts such dots apart (`async`), and the compiled program's FLOPs
by operand type are exact either way.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import re
import tempfile
import time

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$")


def _computations(hlo_text: str) -> dict:
    """computation name -> [(instruction, result type, opcode, operands, attributes)]."""
    out, current = {}, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append(m.groups())
    return out


def _dims(type_text: str) -> list:
    m = re.match(r"\w+\[([\d,]*)\]", type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _element(type_text: str) -> str:
    m = re.match(r"(\w+)\[", type_text)
    return m.group(1) if m else "tuple"


def _dot(result: str, operands: str, attrs: str, types: dict):
    """(FLOPs, (lhs element type, rhs element type)) of one dot instruction."""
    lhs, rhs = re.findall(r"%([\w.\-]+)", operands)[:2]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    k = math.prod(_dims(types[lhs])[int(d)] for d in contracting.group(1).split(",") if d) \
        if contracting else 1
    return 2.0 * math.prod(_dims(result)) * k, (_element(types[lhs]), _element(types[rhs]))


def _dots(computations: dict, name: str, seen=()) -> list:
    """`_dot` of every dot `name` runs, through the computations it calls."""
    found = []
    instructions = computations.get(name, [])
    types = {i[0]: i[1] for i in instructions}
    for inst, result, opcode, operands, attrs in instructions:
        if opcode == "dot":
            found.append(_dot(result, operands, attrs, types))
        for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", attrs):
            if callee not in seen:
                found += _dots(computations, callee, seen + (callee,))
    return found


def matmul_ops(hlo_text: str) -> dict:
    """op name -> (FLOPs per run, 'bf16' | 'f32' | 'mixed' | ...) for every op of the compiled
    program that is a dot or a fusion around dots (loops and conditionals are not: their
    bodies' ops are events of their own)."""
    computations = _computations(hlo_text)
    fused = {callee for instructions in computations.values() for *_, opcode, _, attrs in instructions
             if opcode == "fusion" for callee in re.findall(r"calls=%([\w.\-]+)", attrs)}
    ops = {}
    for name, instructions in computations.items():
        if name in fused:  # a fusion's body runs as the fusion's op
            continue
        types = {i[0]: i[1] for i in instructions}
        for inst, result, opcode, operands, attrs in instructions:
            if opcode == "dot":
                dots = [_dot(result, operands, attrs, types)]
            elif opcode == "fusion":
                callee = re.search(r"calls=%([\w.\-]+)", attrs)
                dots = _dots(computations, callee.group(1)) if callee else []
            else:
                continue
            if dots:
                kinds = {t for _, pair in dots for t in pair}
                kind = kinds.pop() if len(kinds) == 1 else "mixed"
                ops[inst] = (sum(f for f, _ in dots), kind)
    return ops


def dot_flops_by_type(hlo_text: str, runs: dict | None = None) -> dict:
    """operand type -> FLOPs of the program's dots (times each op's `runs` when given)."""
    out = collections.Counter()
    for name, (flops, kind) in matmul_ops(hlo_text).items():
        out[kind] += flops * ((runs or {}).get(name, 1))
    return dict(out)


def op_times(trace_dir: str):
    """(exclusive microseconds, runs) per op name, from the newest perfetto trace under `trace_dir`."""
    files = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(files[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    exclusive, runs = collections.Counter(), collections.Counter()
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                exclusive[stack[-1]["name"]] -= e["dur"]
            exclusive[e["name"]] += e["dur"]
            runs[e["name"]] += 1
            stack.append(e)
    return exclusive, runs


# Runtime events around the ops (dispatch, waits, Python frames): not XLA ops.
_RUNTIME = ("ThunkExecutor", "$", "PjitFunction", "Common", "PjRt", "Pjrt", "Slinky", "Threadpool",
            "Handle", "Parse", "Allocate", "Wait", "Python", "end: ", "TfrtCpu", "ExecuteHelper")


def breakdown(hlo_text: str, exclusive: dict, runs: dict, top: int = 8) -> list:
    """Rows (kind, seconds, runs, FLOPs) of the traced call: matmuls by operand type, then the
    `top` other op kinds by time and the rest together."""
    matmuls = matmul_ops(hlo_text)
    groups = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for name, us in exclusive.items():
        if us <= 0 or name.startswith(_RUNTIME):
            continue
        if name in matmuls:
            flops, kind = matmuls[name]
            # a dot timed faster than 20 TFLOP/s was launched, not run, by this event
            key = f"matmul {kind}" if flops * runs[name] / (us * 1e-6) < 2e13 else f"matmul {kind} (async)"
            groups[key][2] += flops * runs[name]
        else:
            key = re.sub(r"(\.\d+)*(\.clone)?$", "", name)
        groups[key][0] += us * 1e-6
        groups[key][1] += runs[name]
    rows = sorted(((k, s, n, f) for k, (s, n, f) in groups.items()), key=lambda r: -r[1])
    keep = [r for r in rows if r[0].startswith("matmul")]
    others = [r for r in rows if not r[0].startswith("matmul")]
    keep += others[:top]
    if others[top:]:
        keep.append(("other ops", sum(r[1] for r in others[top:]), sum(r[2] for r in others[top:]), 0.0))
    return keep


def profile_call(fn, *args, trace_dir: str | None = None, top: int = 8):
    """Calls `fn(*args)` once under the profiler (compile it first: the traced call should not
    compile) and returns (breakdown rows, the call's wall seconds). `fn` must be jitted; its
    compiled program is looked up for the same arguments."""
    import jax

    hlo_text = fn.lower(*args).compile().as_text()
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="xla_profile_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        wall = time.perf_counter() - t0
    exclusive, runs = op_times(trace_dir)
    return breakdown(hlo_text, exclusive, runs, top=top), wall


def format_rows(rows: list, wall_s: float, matmul_rate: float | None = None) -> str:
    """A markdown table of `breakdown` rows; `matmul_rate` (FLOP/s) adds each matmul kind's share of it."""
    busy = sum(r[1] for r in rows)
    lines = [f"one traced call: {wall_s:.2f} s wall, {busy:.2f} thread-seconds in XLA ops",
             "", "| ops | thread-s | share | runs | TFLOP | GFLOP/s | of matmul rate |", "|---|---|---|---|---|---|---|"]
    for kind, s, n, flops in rows:
        rate = flops / s if flops and s else 0.0
        of_peak = f"{rate / matmul_rate:.0%}" if rate and matmul_rate else ""
        lines.append(f"| {kind} | {s:.2f} | {s / busy:.0%} | {n} | {flops / 1e12:.2f} | "
                     f"{rate / 1e9:.0f} | {of_peak} |" if flops else
                     f"| {kind} | {s:.2f} | {s / busy:.0%} | {n} | | | |")
    return "\n".join(lines)
