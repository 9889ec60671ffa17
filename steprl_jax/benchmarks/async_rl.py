"""Asynchronous rollouts against the synchronous loop: trained trajectories per hour, same work.

    python -m steprl_jax.benchmarks.async_rl [--iterations 6] [--queries 4] [--eval-tasks 48]
                                             [--warm-start PATH] [--json PATH]

(from the repo root: it reads configs/portool_toolworld.py; JAX_PLATFORMS=cpu on a CPU host.) PORTool and GRPO on the tool world,
SmolLM2-135M-Instruct from one SFT warm start (trained here once into `--workdir`, or
`--warm-start PATH`), every tool call taking 0.5-2 s (`task.latency_min_s/max_s`: a function of
the call) and every outcome judged over HTTP by a server on 127.0.0.1 that answers after
`--judge-latency` s (benchmarks/verdict_server.py: the tool world's rule read from PORTool's
verdict prompt). For each method: the synchronous loop (`rl.asynchronous.max_staleness` 0) and
asynchronous rollouts 1 and 2 versions behind (deterministic lag), the same iterations of the
same queries, so the same number of trained trajectories.

Throughput: trajectories trained in iterations 2..N over the wall time from the end of iteration 1
to the end of iteration N (the first iteration compiles and fills the pipeline), in trajectories
per hour; the ratio is async / sync of the same method. Learning check: held-out accuracy of each
run's final policy (greedy, `--eval-tasks` queries, the same judge), its 95% interval, and its
paired difference from the synchronous run of the method on the same queries; the check passes
when the async accuracy lies inside the synchronous run's interval.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from steprl_jax.benchmarks.host import describe, measure_machine
from steprl_jax.benchmarks.verdict_server import VerdictServer

METHODS = ("portool", "grpo")
STALENESS = (0, 1, 2)


def base_config(args, workdir: str, judge_url: str):
    from configs import portool_toolworld

    c = portool_toolworld.get_config()
    c.workdir, c.progress = workdir, False
    c.model.compute_dtype = args.dtype
    c.task.latency_min_s, c.task.latency_max_s = args.tool_latency
    c.judge.outcome.update(dict(kind="http", base_url=judge_url, model="rule-over-http", votes=1, timeout_s=30.0))
    return c


def warm_start(args, judge_url: str) -> str:
    """An exported SFT policy: `--warm-start`, or trained once in the workdir (reused after)."""
    if args.warm_start:
        return args.warm_start
    from steprl_jax.algorithms import online

    c = base_config(args, os.path.join(args.workdir, "warm_start"), judge_url)
    c.rl.warm_start.updates = args.warm_start_updates
    c.rl.warm_start.learning_rate = 5e-5
    c.rl.iterations, c.rl.eval.num_tasks = 0, 0
    out = os.path.join(c.workdir, "policy", "sft")
    if not os.path.isdir(out):
        online.run(c)
    return out


def run_one(args, method: str, staleness: int, source: str, judge_url: str) -> dict:
    """One run: its iteration times, trained trajectories and the final policy's held-out evaluation."""
    from steprl_jax.algorithms import online
    from steprl_jax.training import distributed
    from steprl_jax.training.metrics_log import read_metrics

    workdir = os.path.join(args.workdir, f"{method}_staleness{staleness}")
    c = base_config(args, workdir, judge_url)
    c.algorithm = method
    c.rl.warm_start.source = source
    c.rl.iterations, c.rl.queries_per_iteration = args.iterations, args.queries
    c.rl.save_every = args.iterations
    c.rl.eval.num_tasks = 0  # evaluated below, outside the timed iterations
    c.rl.asynchronous.max_staleness = staleness
    c.optimizer.learning_rate = args.lr
    model, tokenizer = distributed.load_policy(c, source)
    loop = online.build_loop(c, model, tokenizer, base_source=source)
    try:
        t0 = time.perf_counter()
        loop.run()
        run_s = time.perf_counter() - t0
        rows = read_metrics(workdir)["rl"][-args.iterations:]
        e = c.copy_and_resolve_references()
        e.rl.eval.num_tasks, e.rl.eval.votes = args.eval_tasks, 1
        evaluate = online.held_out_evaluation(e, model, tokenizer, loop.sampler)
        metrics = evaluate(os.path.join(workdir, "eval"), f"iter_{args.iterations:05d}.")
    finally:
        loop.close()
    trained = [row["leaves"] - row.get("judge_failed", 0) for row in rows]
    window_s = rows[-1]["time"] - rows[0]["time"]
    return {"method": method, "staleness": staleness, "run_s": run_s, "timed_window_s": window_s,
            "trajectories_timed": sum(trained[1:]), "trajectories_per_hour": 3600 * sum(trained[1:]) / window_s,
            "iteration_s": [row.get("iteration_s") for row in rows],
            # where the time went: sampling and judging, training, the learner waiting for data
            "rollout_s": [row.get("rollout_s", 0.0) + row.get("judge_s", 0.0) for row in rows],
            "train_s": [row.get("train_s", 0.0) for row in rows], "wait_s": [row.get("wait_s") for row in rows],
            # inside the rollouts, over the timed iterations: prefill, append, decode, tool waits
            "rollout_parts_s": {name[len("rollout_"):]: sum(row.get(name, 0.0) for row in rows[1:])
                                for name in ("rollout_prefill_s", "rollout_append_s", "rollout_generate_s",
                                             "rollout_tool_wait_s")},
            "reward_mean": [row.get("reward_mean") for row in rows],
            "is_weight_mean": [row.get("is_weight_mean") for row in rows],
            "accuracy": metrics["ci"]["accuracy"], "per_question": metrics["ci"].get("per_question", {})}


def overlap_bound(sync: dict) -> float:
    """The ratio a perfect overlap would reach from the synchronous run's own phase times (timed
    iterations): sum(rollout + train) / sum(max(rollout, train)). Sampling and training share the
    host's cores, so each slows the other and the measured ratio stays below it."""
    phases = list(zip(sync["rollout_s"][1:], sync["train_s"][1:]))
    return sum(r + t for r, t in phases) / sum(max(r, t) for r, t in phases)


def learning_check(sync: dict, other: dict) -> dict:
    from steprl_jax.evaluation.stats import paired_diff_ci

    acc = sync["accuracy"]
    pick = lambda run: {q: t["accuracy"] for q, t in run["per_question"].items()}
    diff = paired_diff_ci(pick(sync), pick(other))
    return {"within_sync_interval": bool(acc["lo"] <= other["accuracy"]["value"] <= acc["hi"]),
            "paired_diff": diff}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/bench_async_rl")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--staleness", nargs="+", type=int, default=list(STALENESS))
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--eval-tasks", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--tool-latency", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN_S", "MAX_S"))
    p.add_argument("--judge-latency", type=float, default=1.0)
    p.add_argument("--warm-start", default="", help="an exported policy to start from (default: SFT here)")
    p.add_argument("--warm-start-updates", type=int, default=40)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if 0 not in args.staleness:
        p.error("--staleness must include 0 (the synchronous reference)")
    if args.iterations < 2:
        p.error("--iterations must be >= 2 (the first is not timed)")
    import jax

    # Compiled programs persist across runs of the benchmark (each run's first iteration, not
    # timed, compiles the rest); JAX_COMPILATION_CACHE_DIR moves the cache, "" switches it off.
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/steprl_jax/jax"))
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
    rates, bandwidth = measure_machine()
    print(f"host: {describe(rates, bandwidth)}")
    results = []
    with VerdictServer(latency_s=args.judge_latency) as server:
        source = warm_start(args, server.base_url)
        for method in args.methods:
            for k in sorted(args.staleness):
                r = run_one(args, method, k, source, server.base_url)
                results.append(r)
                print(f"{method:8s} staleness {k}: {r['trajectories_per_hour']:8.0f} trajectories/h "
                      f"(window {r['timed_window_s']:.0f} s, {r['trajectories_timed']:.0f} trajectories), held-out "
                      f"accuracy {r['accuracy']['value']:.3f} [{r['accuracy']['lo']:.3f}, {r['accuracy']['hi']:.3f}]",
                      flush=True)
    summary = []
    for method in args.methods:
        runs = {r["staleness"]: r for r in results if r["method"] == method}
        for k, r in sorted(runs.items()):
            if k == 0:
                continue
            check = learning_check(runs[0], r)
            ratio = r["trajectories_per_hour"] / runs[0]["trajectories_per_hour"]
            summary.append({"method": method, "staleness": k, "ratio": ratio, "overlap_bound": overlap_bound(runs[0]),
                            **check})
            d = check["paired_diff"]
            print(f"{method:8s} staleness {k} / sync: {ratio:.2f}x trajectories per hour (a perfect overlap of "
                  f"the sync run's phases: {overlap_bound(runs[0]):.2f}x); accuracy "
                  f"{r['accuracy']['value']:.3f} vs sync {runs[0]['accuracy']['value']:.3f} "
                  f"(paired diff {d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]; inside the sync interval: "
                  f"{check['within_sync_interval']})" if d else f"{method} staleness {k}: {ratio:.2f}x")
    if args.json:
        for r in results:
            r.pop("per_question", None)
        with open(args.json, "w") as f:
            json.dump({"host": describe(rates, bandwidth), "args": vars(args), "runs": results, "summary": summary},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
