"""Run metrics from trajectory records, and a one-page PNG summary."""
from __future__ import annotations

import collections
from typing import Sequence

from steprl_jax.agents.records import Trajectory
from steprl_jax.io import save_figure_atomic


def trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict:
    """Accuracy (outcome verdict 'true'), mean steps, terminations, tool error rate, process GOOD rate."""
    n = len(trajectories)
    outcomes = collections.Counter(t.judgements.get("outcome", {}).get("label", "missing") for t in trajectories)
    terminations = collections.Counter(t.termination for t in trajectories)
    calls = [r for t in trajectories for s in t.steps for r in s.tool_results]
    tool_errors = sum(1 for r in calls if "error" in r)
    process = [v.get("label") for t in trajectories for v in t.judgements.get("process", [])]
    gen_tokens = sum(len(s.action_ids) for t in trajectories for s in t.steps)
    kinds = collections.Counter(s.kind for t in trajectories for s in t.steps)
    return {
        "episodes": n,
        "accuracy": outcomes.get("true", 0) / n if n else 0.0,
        "outcomes": dict(outcomes),
        "mean_steps": sum(len(t.steps) for t in trajectories) / n if n else 0.0,
        "terminations": dict(terminations),
        "action_kinds": dict(kinds),
        "tool_calls": len(calls),
        "tool_error_rate": tool_errors / len(calls) if calls else 0.0,
        "process_good_rate": process.count("GOOD") / len(process) if process else None,
        "process_unparsed": sum(1 for p in process if p not in ("GOOD", "BAD")),
        "generated_tokens": gen_tokens,
    }


# Per-episode (numerator, denominator) of the metrics reported with confidence intervals.
def episode_terms(t: Trajectory) -> dict:
    """accuracy (outcome 'true'), process_correctness (GOOD share of judged steps),
    reference_process_correctness (the same under the reference-guided step judge, where the tasks
    have reference solutions: `judges.judging`), mean_actions, and PORTool's metrics: tool_steps (steps that parsed to at least one tool call, response_gen
    included), unanswerable (the episode never called response_gen: termination is not
    'answer'), format_reward (R_fm = c * (2 * passed - 1) per step, c = 0.25, steps with checks)."""
    from steprl_jax.tools.formats import formatting_reward

    def good_of_judged(key: str) -> tuple[float, float]:
        judged = [x for x in (v.get("label") for v in t.judgements.get(key, [])) if x in ("GOOD", "BAD")]
        return float(judged.count("GOOD")), float(len(judged))

    checked = [s for s in t.steps if s.format_checks]
    return {"accuracy": (float(t.judgements.get("outcome", {}).get("label") == "true"), 1.0),
            "process_correctness": good_of_judged("process"),
            "reference_process_correctness": good_of_judged("reference_process"),
            "mean_actions": (float(len(t.steps)), 1.0),
            "tool_steps": (float(sum(1 for s in t.steps if s.tool_calls or s.kind == "answer")), 1.0),
            "unanswerable": (float(t.termination != "answer"), 1.0),
            "format_reward": (float(sum(formatting_reward(s.format_checks) for s in checked)), float(len(checked)))}


CI_METRICS = ("accuracy", "process_correctness", "reference_process_correctness", "mean_actions")  # SWiRL's
PAPER_METRICS = ("accuracy", "tool_steps", "unanswerable", "format_reward")  # PORTool's table
_ALL = CI_METRICS + PAPER_METRICS[1:]


def ci_metrics(trajectories: Sequence[Trajectory], seed: int = 0) -> dict:
    """Accuracy (outcome judge), process correctness (share of judged steps called GOOD; failed
    verdicts are left out and counted in `trajectory_metrics`), mean actions per episode and
    PORTool's tool_steps, unanswerable and format_reward (`episode_terms`), each {value, lo, hi, n} with a 95% bootstrap interval over episodes; `per_question` holds each
    question's summed terms for paired comparisons (`stats.paired_diff_ci`)."""
    from steprl_jax.evaluation.stats import ratio_ci

    terms = [episode_terms(t) for t in trajectories]
    out = {name: ratio_ci([x[name][0] for x in terms], [x[name][1] for x in terms], seed=seed)
           for name in _ALL}
    per_question: dict = {}
    for t, x in zip(trajectories, terms):
        q = per_question.setdefault(t.query_id, {name: [0.0, 0.0] for name in _ALL})
        for name in _ALL:
            q[name][0] += x[name][0]
            q[name][1] += x[name][1]
    out["per_question"] = per_question
    return out


def summary_plot(metrics: dict, trajectories: Sequence[Trajectory], path: str, title: str = "") -> None:
    """Outcomes, terminations and steps per episode on one PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("outcome verdicts", metrics["outcomes"]), ("terminations", metrics["terminations"])]
    for ax, (name, counts) in zip(axes, panels):
        labels = sorted(counts)
        ax.bar(labels, [counts[k] for k in labels], color="#4c72b0")
        ax.set_title(name)
        ax.tick_params(axis="x", rotation=20)
    steps = collections.Counter(len(t.steps) for t in trajectories)
    xs = sorted(steps)
    axes[2].bar([str(x) for x in xs], [steps[x] for x in xs], color="#55a868")
    axes[2].set_title("actions per episode")
    good = metrics.get("process_good_rate")
    fig.suptitle(f"{title}  accuracy {metrics['accuracy']:.1%}  mean steps {metrics['mean_steps']:.2f}  "
                 f"tool errors {metrics['tool_error_rate']:.1%}"
                 + (f"  process GOOD {good:.1%}" if good is not None else ""))
    fig.tight_layout()
    save_figure_atomic(fig, path)
