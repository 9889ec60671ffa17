"""The long fuzz run: `python tests/fuzz_long.py --cases 1000000 [--seed 0] [--targets a,b] [--json PATH]`.

Case i goes to target `schedule[i % len(schedule)]` (each target `weight` times in the schedule) with its
input drawn by that target's generator from `random.Random(seed * 2**32 + i)`: the same seed, corpus and
targets give the same cases, and one case is replayed with `--first i --cases 1` (same --seed and --targets).

The cases run in a worker process. The worker records every failure (see `fuzz_targets.run_case`: an
undocumented exception, a broken contract, too much CPU time) and reports back every few thousand cases;
this process watches it, and a case still running after --hang-s seconds is recorded as a hang, the
worker killed and restarted after it. The report gives cases run, failures by kind and target with the
first reproducers, seconds and cases per second; the exit status is 1 when anything unexpected failed.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import pathlib
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPORT_EVERY = 2000
KEEP_PER_KIND = 10  # reproducers kept per kind of failure


def schedule(targets: dict, names: list[str]) -> list[str]:
    return [name for name in names for _ in range(targets[name].weight)]


def make_case(targets: dict, order: list[str], seed: int, index: int):
    from fuzz_targets import RandomSource
    target = targets[order[index % len(order)]]
    return target, target.generate(RandomSource(random.Random(seed * 2**32 + index)))


def worker(names: list[str], seed: int, first: int, stop: int, current, connection) -> None:
    import warnings
    warnings.simplefilter("ignore", SyntaxWarning)  # ast.parse warns about inputs such as "1if"
    from fuzz_targets import Failure, TARGETS, run_case

    order = schedule(TARGETS, names)
    for name in names:
        TARGETS[name].setup()
    counts: collections.Counter = collections.Counter()
    failures: list[dict] = []
    for index in range(first, stop):
        current.value = index
        try:
            target, value = make_case(TARGETS, order, seed, index)
        except Exception as error:  # a bug in a generator, not in the code under test
            failure = Failure(order[index % len(order)], "generator", f"{type(error).__name__}: {error}", None)
        else:
            counts[target.name] += 1
            failure = run_case(target, value)
        if failure is not None:
            failures.append({"index": index, "target": failure.target, "kind": failure.kind,
                             "detail": failure.detail, "input": failure.describe().split("\n    input: ", 1)[-1]})
        if (index + 1 - first) % REPORT_EVERY == 0 or index + 1 == stop:
            connection.send((index + 1, dict(counts), failures))
            counts, failures = collections.Counter(), []
    connection.send(("done", {}, []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument("--targets", default="", help="comma-separated target names (default: all)")
    parser.add_argument("--hang-s", type=float, default=60.0, help="wall seconds before a case counts as a hang")
    parser.add_argument("--json", default="", help="write the report here as JSON")
    args = parser.parse_args(argv)

    from fuzz_targets import TARGETS
    names = [n for n in args.targets.split(",") if n] or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    order = schedule(TARGETS, names)

    context = mp.get_context("spawn")  # a fresh interpreter: JAX (imported by the serving code) dislikes fork
    current = context.RawValue("q", -1)
    per_target: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    by_target_kind: collections.Counter = collections.Counter()
    kept: dict[str, list] = collections.defaultdict(list)

    def record(failure: dict) -> None:
        by_kind[failure["kind"]] += 1
        by_target_kind[f"{failure['target']}:{failure['kind']}"] += 1
        if len(kept[failure["kind"]]) < KEEP_PER_KIND:
            kept[failure["kind"]].append(failure)

    start, next_case, stop = time.monotonic(), args.first, args.first + args.cases
    last_print = start
    while next_case < stop:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=worker, args=(names, args.seed, next_case, stop, current, send), daemon=True)
        current.value = -1
        process.start()
        send.close()
        seen, seen_at, finished = -1, time.monotonic(), False
        while True:
            if receive.poll(1.0):
                try:
                    done, counts, failures = receive.recv()
                except EOFError:
                    break
                if done == "done":
                    finished = True
                    break
                next_case = done
                per_target.update(counts)
                for failure in failures:
                    record(failure)
            elif not process.is_alive():
                break
            now = time.monotonic()
            if current.value != seen:
                seen, seen_at = current.value, now
            elif seen >= 0 and now - seen_at > args.hang_s:
                process.kill()
                target, value = make_case(TARGETS, order, args.seed, seen)
                per_target[target.name] += 1
                record({"index": seen, "target": target.name, "kind": "hang",
                        "detail": f"still running after {args.hang_s:g} s", "input": repr(value)[:400]})
                next_case = seen + 1
                break
            if now - last_print > 60:
                last_print = now
                done_cases = next_case - args.first
                print(f"{done_cases} cases, {dict(by_kind)} failures, {done_cases / (now - start):.0f} cases/s",
                      file=sys.stderr, flush=True)
        process.join(timeout=10)
        if finished:
            break
        if not process.is_alive() and current.value >= next_case and not any(
                f["index"] == current.value for f in kept["hang"]):
            # The worker died on a case (a crash of the interpreter itself): record it and go on after it.
            target, value = make_case(TARGETS, order, args.seed, current.value)
            record({"index": current.value, "target": target.name, "kind": "crash",
                    "detail": f"worker exited with {process.exitcode}", "input": repr(value)[:400]})
            next_case = current.value + 1

    seconds = time.monotonic() - start
    cases = sum(per_target.values())
    unexpected = sum(by_kind.values())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=pathlib.Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    report = {"cases": cases, "unexpected_failures": unexpected,
              "failures_by_kind": dict(by_kind), "failures_by_target": dict(by_target_kind),
              "seconds": round(seconds, 1), "cases_per_s": round(cases / seconds, 1), "seed": args.seed,
              "first": args.first, "targets": len(names), "per_target": dict(per_target),
              "reproducers": {kind: failures for kind, failures in kept.items()},
              "replay": "python tests/fuzz_long.py --seed SEED --first INDEX --cases 1 [--targets ...]",
              "commit": commit, "python": platform.python_version(), "cpus": os.cpu_count()}
    text = json.dumps(report, indent=1, ensure_ascii=False)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
