"""Rollout throughput: our engine vs a naive agent loop, same model, questions and tools.

    python -m steprl_jax.benchmarks.rollouts [--episodes 16] [--tool-latency 0.2] [--json PATH]

Both use the real SmolLM2-135M-Instruct through the same jitted sampler, greedy, the
calculator wrapped to take `--tool-latency` seconds per call.

* ours: all episodes in one batch; tools of all episodes run concurrently; observations are
  appended to each episode's KV cache (continue, no re-prefill).
* naive: one episode at a time; each step re-prefills the whole context from scratch and
  then waits for its tool call.

Prints episodes/s for both, the ratio, and where our time goes (generation, tools, judging).
"""
from __future__ import annotations

import argparse
import json
import time

import jax

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
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
    from steprl_jax.sampling import SamplingParams

    params = SamplingParams(greedy=True)
    env = engine.env
    answers = []
    key = jax.random.PRNGKey(0)
    for task in tasks:
        _, ids = engine.prompt(task)
        final = None
        for _ in range(config.max_steps):
            state = sampler.prefill([ids])
            _, (gen,) = sampler.generate(state, key, max_new_tokens=config.max_new_tokens, params=params,
                                         stop=env.stop_strings)
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--tool-latency", type=float, default=0.2)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--compute-dtype", default="float32")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    from steprl_jax.models import load_pretrained
    from steprl_jax.sampling import Sampler

    model, tokenizer = load_pretrained("smollm2-135m-instruct", compute_dtype=args.compute_dtype)
    sampler = Sampler(model, tokenizer, max_context=2048)
    examples = [p.demonstration() for p in arithmetic_problems(4, seed=10_007)[1:3]]
    env = TaggedEnv(ToolRegistry([slow_calculator(args.tool_latency)], max_workers=64), examples=examples)
    config = RolloutConfig(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens, max_context=2048,
                           temperature=0.0, batch_size=args.episodes, tool_workers=64)
    problems = arithmetic_problems(args.episodes + 2, seed=1)
    tasks = [Task(p.id, p.question, p.answer) for p in problems]

    # Warm up both paths (compilation) on other questions; then measure.
    warm = RolloutEngine(sampler, tokenizer, env, config)
    list(warm.run([(f"w{i}", t) for i, t in enumerate(tasks[-2:] * (args.episodes // 2))]))
    naive_rollouts(sampler, warm, tasks[-2:], config)
    measured = tasks[:args.episodes]

    engine = RolloutEngine(sampler, tokenizer, env, config)
    t0 = time.perf_counter()
    trajectories = list(engine.run([(f"e{i}", t) for i, t in enumerate(measured)]))
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    verdicts = [rules.gsm8k_outcome(t.final_answer, task.reference) for t, task in zip(trajectories, measured)]
    judge_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    naive_answers = naive_rollouts(sampler, engine, measured, config)
    naive_s = time.perf_counter() - t0

    ours_eps, naive_eps = len(measured) / ours_s, len(measured) / naive_s
    steps = sum(len(t.steps) for t in trajectories)
    calls = sum(len(s.tool_calls) for t in trajectories for s in t.steps)
    stats = engine.stats
    print(f"episodes={len(measured)}  tool latency={args.tool_latency:.3f}s  steps={steps}  tool calls={calls}")
    print(f"{'':10s}{'wall s':>10s}{'episodes/s':>12s}")
    print(f"{'ours':10s}{ours_s:10.2f}{ours_eps:12.3f}")
    print(f"{'naive':10s}{naive_s:10.2f}{naive_eps:12.3f}")
    print(f"ratio (ours / naive episodes per second): {ours_eps / naive_eps:.2f}x")
    print("where our time goes: "
          f"prefill {stats.prefill_s:.2f}s, generate {stats.generate_s:.2f}s, append {stats.append_s:.2f}s, "
          f"waiting on tools {stats.tool_wait_s:.2f}s, judging {judge_s:.4f}s; "
          f"{stats.generate_calls} generate calls, {stats.generated_tokens} tokens")
    print(f"accuracy ours {verdicts.count('true')}/{len(measured)}, "
          f"naive {sum(rules.gsm8k_outcome(a, t.reference) == 'true' for a, t in zip(naive_answers, measured))}"
          f"/{len(measured)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"episodes": len(measured), "tool_latency_s": args.tool_latency, "ours_s": ours_s,
                       "naive_s": naive_s, "ratio": ours_eps / naive_eps, "judge_s": judge_s,
                       "stats": stats.to_json()}, f, indent=2)


if __name__ == "__main__":
    main()
