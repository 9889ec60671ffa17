"""Rollout throughput: continuous batching vs the batch-at-a-time engine (and, optionally, a naive
agent loop), same model, questions, tools and sampling keys, in the same run.

    python -m steprl_jax.benchmarks.rollouts [--episodes 64] [--batch 16] [--tool-latency 0.2]
                                             [--naive] [--json PATH]

All use the real SmolLM2-135M-Instruct through the same jitted sampler on arithmetic questions
with the calculator, each tool call taking `--tool-latency` seconds. Sampling at temperature 1
gives the long-tailed action lengths of RL rollouts (most actions are short, a few run to the
token cap); every episode has its own key, so both engines sample the same actions.

* continuous: `--batch` cache rows; the decode returns every `--decode-chunk` tokens or when a
  row finishes its action; that row's tool starts at once, rows back from their tools join the
  next call, and a finished episode's row takes the next waiting episode.
* batch: `--batch` episodes at a time; each generation call runs until all its rows stop, and
  the next batch starts when the slowest episode of this one ends (the engine before
  continuous batching).
* naive (`--naive`): one episode at a time; each step re-prefills the whole context.

Prints episodes/s for each, the ratio continuous / batch, the action-length distribution,
where the time goes, and the decode throughput against this machine's roofline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.benchmarks.generation import _roofline
from steprl_jax.benchmarks.host import describe, measure_machine
from steprl_jax.data.arithmetic import arithmetic_problems
from steprl_jax.judges import rules
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.protocol import Tool
from steprl_jax.tools.registry import ToolRegistry


def slow_calculator(latency_s: float) -> Tool:
    base = calculator_tool()

    def run(expression):
        time.sleep(latency_s)
        return base.fn(expression=expression)

    return Tool(base.name, base.description, base.parameters, run, timeout_s=10.0)


def naive_rollouts(sampler, engine: RolloutEngine, tasks, config: RolloutConfig):
    """One episode at a time, re-prefilling the whole context at every step."""
    env = engine.env
    answers = []
    key = jax.random.PRNGKey(0)
    for task in tasks:
        _, ids = engine.prompt(task)
        final = None
        for step in range(config.max_steps):
            state = sampler.prefill([ids])
            _, (gen,) = sampler.generate(state, jax.random.fold_in(key, step), max_new_tokens=config.max_new_tokens,
                                         params=engine._params(), stop=env.stop_strings)
            text = (gen.text or "") + gen.text_after_stop
            parsed = env.parse(text)
            calls = env.calls_for(parsed)
            results = env.registry.execute([c.to_json() for c in calls]) if calls else []
            outcome = env.outcome(task, parsed, results)
            ids = ids + [int(t) for t in gen.tokens] + env.observation_ids(engine.tokenizer, outcome.observation_text)
            if outcome.final_answer is not None:
                final = outcome.final_answer
                break
        answers.append(final)
    return answers


def _timed_run(sampler, tokenizer, env, config, episodes, seed):
    engine = RolloutEngine(sampler, tokenizer, env, config, seed=seed)
    t0 = time.perf_counter()
    trajectories = list(engine.run(episodes))
    wall = time.perf_counter() - t0
    engine.close()
    return trajectories, wall, engine.stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tool-latency", type=float, default=0.2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--decode-chunk", type=int, default=16)
    parser.add_argument("--compute-dtype", default="float32")
    parser.add_argument("--naive", action="store_true", help="also time the naive loop (slow)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    from steprl_jax.models import load_pretrained
    from steprl_jax.sampling import Sampler

    rates, bandwidth = measure_machine()
    print(describe(rates, bandwidth))
    model, tokenizer = load_pretrained("smollm2-135m-instruct", compute_dtype=args.compute_dtype)
    sampler = Sampler(model, tokenizer, max_context=2048)
    examples = [p.demonstration() for p in arithmetic_problems(4, seed=10_007)[1:3]]
    env = TaggedEnv(ToolRegistry([slow_calculator(args.tool_latency)], max_workers=64), examples=examples)
    batch_config = RolloutConfig(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens, max_context=2048,
                                 temperature=args.temperature, batch_size=args.batch, tool_workers=64,
                                 continuous=False)
    configs = {"continuous": dataclasses.replace(batch_config, continuous=True, decode_chunk=args.decode_chunk),
               "batch": batch_config}
    problems = arithmetic_problems(2 * args.episodes, seed=1)
    tasks = [Task(p.id, p.question, p.answer) for p in problems]
    measured, warm_tasks = tasks[:args.episodes], tasks[args.episodes:]

    # Warm up (compilation) on other questions, half as many; then measure each engine.
    for config in configs.values():
        _timed_run(sampler, tokenizer, env, config, [(f"w{i}", t) for i, t in enumerate(warm_tasks[:args.episodes // 2])],
                   seed=1)
    episodes = [(f"e{i}", t) for i, t in enumerate(measured)]
    results = {name: _timed_run(sampler, tokenizer, env, config, episodes, seed=0) for name, config in configs.items()}
    naive_s = None
    if args.naive:
        t0 = time.perf_counter()
        naive_rollouts(sampler, RolloutEngine(sampler, tokenizer, env, batch_config), measured, batch_config)
        naive_s = time.perf_counter() - t0

    reference = {t.id: t for t in results["batch"][0]}
    same = sum(all(a.action_ids == b.action_ids for a, b in zip(t.steps, reference[t.id].steps))
               and len(t.steps) == len(reference[t.id].steps) for t in results["continuous"][0])
    lengths = np.asarray([len(s.action_ids) for t in results["batch"][0] for s in t.steps])
    print(f"episodes={len(measured)}  batch={args.batch}  tool latency={args.tool_latency:.3f}s  "
          f"temperature={args.temperature}  decode chunk={args.decode_chunk}  dtype={args.compute_dtype}")
    print(f"action lengths (tokens): mean {lengths.mean():.1f}, p50 {np.percentile(lengths, 50):.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()} (cap {args.max_new_tokens}); "
          f"{len(lengths)} actions; episodes with identical actions in both engines: {same}/{len(measured)}")
    print(f"{'':12s}{'wall s':>9s}{'episodes/s':>12s}{'gen calls':>10s}{'gen s':>8s}{'tool wait s':>12s}"
          f"{'prefill s':>10s}{'tokens':>8s}{'gen tok/s':>10s}{'% roof':>7s}")
    out = {"machine": {"matmul_flops": rates, "bandwidth": bandwidth}, "episodes": len(measured),
           "batch": args.batch, "tool_latency_s": args.tool_latency, "temperature": args.temperature,
           "decode_chunk": args.decode_chunk, "action_length_mean": float(lengths.mean()),
           "action_length_p90": float(np.percentile(lengths, 90)), "identical_episodes": same}
    prompt_len = float(np.mean([len(t.prompt_ids) for t in results["batch"][0]]))
    roof = _roofline(model.config, args.batch, prompt_len + lengths.mean() * args.max_steps / 2, 1,
                     rates["bfloat16" if args.compute_dtype == "bfloat16" else "float32"], bandwidth,
                     2 if args.compute_dtype == "bfloat16" else 4)
    for name, (trajectories, wall, stats) in results.items():
        accuracy = sum(rules.gsm8k_outcome(t.final_answer, t.reference_answer) == "true" for t in trajectories)
        tok_s = stats.generated_tokens / max(stats.generate_s, 1e-9)
        print(f"{name:12s}{wall:9.2f}{len(measured) / wall:12.3f}{stats.generate_calls:10d}{stats.generate_s:8.2f}"
              f"{stats.tool_wait_s:12.2f}{stats.prefill_s:10.2f}{stats.generated_tokens:8d}{tok_s:10.1f}"
              f"{100 * tok_s / roof:6.1f}%")
        out[name] = {"wall_s": wall, "episodes_per_s": len(measured) / wall, "accuracy": accuracy,
                     "generated_tokens_per_s": tok_s, "stats": stats.to_json()}
    if naive_s is not None:
        print(f"{'naive':12s}{naive_s:9.2f}{len(measured) / naive_s:12.3f}")
        out["naive"] = {"wall_s": naive_s, "episodes_per_s": len(measured) / naive_s}
    ratio = results["batch"][1] / results["continuous"][1]
    out["ratio"] = ratio
    out["roofline_tokens_per_s"] = roof
    print(f"decode roofline at batch {args.batch}: {roof:.0f} tok/s ({args.compute_dtype}; generated tokens over "
          "time in generation calls, every row of a call counted once)")
    print(f"ratio (continuous / batch episodes per second): {ratio:.2f}x  (target >= 1.5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
