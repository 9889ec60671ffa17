"""Tool-call steps against the reference plans (tool world): does a policy call tools it did not
need (more steps than its query's plan: what PORTool's "fewer tool calls" removes) or stop short
(fewer steps than the plan: an answer before the facts it needs)?

    python -m steprl_jax.evaluation.plan_steps --config=configs/portool_toolworld.py \\
        --config.task.num_tasks=256 --config.task.eval_num_tasks=96 [--json PATH] FILE [FILE ...]

Each FILE is an evaluation's trajectories (`eval/iter_NNNNN.trajectories.jsonl[.gz]`); the config
names the queries it evaluated (the test split of `task`, as the run's own config did). Steps
count as the evaluation's `tool_steps` does: steps with tool calls, and the answer; a plan's are its
steps of calls and the final answer.
"""
from __future__ import annotations

import sys

from steprl_jax.agents.tasks import split_config, toolworld_queries
from steprl_jax.errors import ConfigError
from steprl_jax.evaluation.compare import markdown_rows
from steprl_jax.io import DataFormatError, load_records, write_json_atomic


def episode_steps(record: dict) -> int:
    """A trajectory record's tool-call steps, the answer included (`metrics.ci_metrics`' count)."""
    return sum(1 for s in record["steps"] if s.get("tool_calls") or s.get("kind") == "answer")


def steps_against_plans(records: list, plan_steps: dict, where: str = "trajectories") -> dict:
    """Counts over `records` (trajectory records) of the steps taken against `plan_steps`
    ({query id: the reference plan's steps}): all, and the correct and wrong ones apart."""
    def summary(rows):
        taken = [episode_steps(r) for r in rows]
        planned = [plan_steps[r["query_id"]] for r in rows]
        n = len(rows)
        return {"n": n, "steps": sum(taken) / n if n else float("nan"),
                "plan_steps": sum(planned) / n if n else float("nan"),
                "fewer": sum(t < p for t, p in zip(taken, planned)), "more": sum(t > p for t, p in zip(taken, planned))}

    unknown = sorted({r["query_id"] for r in records} - plan_steps.keys())
    if unknown:
        raise ConfigError(f"{where}: {len(unknown)} query ids are not among the config's {len(plan_steps)} "
                          f"queries (first: {unknown[0]!r}): check task.num_tasks, task.eval_num_tasks, task.seed")
    correct = [r for r in records if r["judgements"]["outcome"]["label"] == "true"]
    wrong = [r for r in records if r["judgements"]["outcome"]["label"] != "true"]
    return {"all": summary(records), "correct": summary(correct), "wrong": summary(wrong)}


def table(results: dict) -> str:
    head = ["trajectories", "n", "steps", "plan steps", "fewer than plan", "more than plan",
            "correct: steps / plan", "wrong: steps / plan"]
    rows = [[name, str(r["all"]["n"]), f"{r['all']['steps']:.2f}", f"{r['all']['plan_steps']:.2f}",
             str(r["all"]["fewer"]), str(r["all"]["more"]),
             f"{r['correct']['steps']:.2f} / {r['correct']['plan_steps']:.2f} (n {r['correct']['n']})",
             f"{r['wrong']['steps']:.2f} / {r['wrong']['plan_steps']:.2f} (n {r['wrong']['n']})"]
            for name, r in results.items()]
    return "\n".join(markdown_rows(head, rows))


def main(config, files: list, json_path: str | None = None) -> dict:
    _, queries = toolworld_queries(split_config(config, "test"))
    plan_steps = {q.id: len(q.plan) for q in queries}
    results = {path: steps_against_plans(load_records(path, lambda record, where: record), plan_steps, path)
               for path in files}
    print(table(results))
    if json_path:
        write_json_atomic(json_path, results)
    return results


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", "configs/portool_toolworld.py", "The run's config.")
    _JSON = flags.DEFINE_string("json", None, "Also write the counts here.")

    def _run(argv):
        if len(argv) < 2:
            sys.exit("plan_steps: name at least one trajectories file")
        try:
            main(_CONFIG.value, argv[1:], _JSON.value)
        except (ConfigError, DataFormatError, OSError) as err:
            sys.exit(f"plan_steps: {err}")

    app.run(_run)
