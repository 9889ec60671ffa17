"""Comparisons of evaluated policies: the tables (95% intervals, paired differences from a
reference policy on the same questions) and their plots. Two of them:

* Runs side by side, the way the PORTool paper's table does (`load_run`, `comparison`, `main`):

    python -m steprl_jax.evaluation.compare WORKDIR [WORKDIR ...] [--out PATH_PREFIX]

  Each WORKDIR holds `run.json` ({"job": "rl", "algorithm": ...}), `metrics.jsonl` (train-batch
  lines of stage "rl") and `eval/iter_NNNNN.metrics.json` (held-out evaluation after NNNNN
  iterations, 00000 = the warm-started policy; its "ci" maps each paper metric to
  {value, lo, hi, n}, a 95% bootstrap interval). Prints a markdown table, one row per method from
  its last evaluation, after a first row for the warm start (iteration 0 of the first workdir that
  has it), and writes PATH_PREFIX.md, PATH_PREFIX.json and PATH_PREFIX.png (default `comparison`).

  Where the evaluations hold each question's terms ("ci" -> "per_question"), a second table gives
  each method's difference from the warm start on the questions both answered, with a paired
  bootstrap interval (`stats.paired_diff_ci`): far narrower than two separate intervals when both
  policies find the same questions easy or hard. `--start-label` names that reference row (e.g.
  "base" when the first WORKDIR is the untrained model); runs that started from another policy
  (their own iteration 0 differs) get a third table, their difference from their own start.

* The policies of one SWiRL run (`write_policy_comparison`): base, SFT and SWiRL on SWiRL's
  metrics, each trained policy's paired difference from the base, into the run's `comparison.md`,
  `eval/comparison.json` and `curves.png` (training curves and eval points).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from typing import Sequence

from steprl_jax.evaluation.metrics import CI_METRICS, PAPER_METRICS
from steprl_jax.evaluation.stats import diff_cell, paired_diff_ci
from steprl_jax.io import save_figure_atomic, write_json_atomic, write_text_atomic
from steprl_jax.training.metrics_log import read_metrics

TITLES = {"accuracy": "accuracy", "process_correctness": "process correctness",
          "reference_process_correctness": "process correctness (reference judge)", "mean_actions": "actions / episode",
          "tool_steps": "mean tool-call steps", "unanswerable": "unanswerable rate",
          "format_reward": "mean format reward / step"}
_EVAL_FILE = re.compile(r"iter_(\d{5})\.metrics\.json")


def _paired(before: dict, after: dict, metrics: Sequence[str]) -> dict:
    """{metric: paired difference (after - before)} over the questions both hold, from
    {question: {metric: [numerator, denominator]}} terms (`metrics.ci_metrics`' per_question)."""
    return {m: paired_diff_ci({q: t[m] for q, t in before.items()}, {q: t[m] for q, t in after.items()})
            for m in metrics}


def markdown_rows(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


# ----------------------------------------------------------------------------- runs side by side
def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as error:
        raise ValueError(f"{path}: malformed JSON ({error})") from None


def _read_eval(path: str) -> tuple:
    """({metric: {value, lo, hi, n}} of the paper metrics, {question: {metric: [num, den]}}) of
    one evaluation file (the second empty where the file has no per-question terms)."""
    data = _read_json(path)
    ci = data.get("ci") if isinstance(data, dict) else None
    missing = [m for m in PAPER_METRICS if not isinstance(ci, dict) or not isinstance(ci.get(m), dict)]
    if missing:
        raise ValueError(f"{path}: no 'ci' entry for {missing}")
    per_question = ci.get("per_question")
    if not isinstance(per_question, dict) or not all(
            isinstance(terms, dict) and all(m in terms for m in PAPER_METRICS) for terms in per_question.values()):
        per_question = {}
    return {m: {k: ci[m].get(k) for k in ("value", "lo", "hi", "n")} for m in PAPER_METRICS}, per_question


def _reward_curve(workdir: str) -> list:
    try:
        rows = read_metrics(workdir).get("rl", [])
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{os.path.join(workdir, 'metrics.jsonl')}: a line without 'stage'/'step' "
                         f"({error!r})") from None
    return [[row["step"], row["reward_mean"]] for row in rows if "reward_mean" in row]


def load_run(workdir: str) -> dict:
    """One workdir: its algorithm, evaluations by iteration and train-batch reward curve."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"{workdir}: no such workdir")
    manifest_path = os.path.join(workdir, "run.json")
    if not os.path.exists(manifest_path):
        raise FileNotFoundError(f"{manifest_path}: missing (not a run workdir?)")
    manifest = _read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("job") != "rl" or "algorithm" not in manifest:
        raise ValueError(f"{manifest_path}: expected an object with job 'rl' and an 'algorithm'")
    eval_dir = os.path.join(workdir, "eval")
    names = sorted(os.listdir(eval_dir)) if os.path.isdir(eval_dir) else []
    read = {int(m.group(1)): _read_eval(os.path.join(eval_dir, n))
            for n in names if (m := _EVAL_FILE.fullmatch(n))}
    if not read:
        raise FileNotFoundError(f"{eval_dir}: no iter_NNNNN.metrics.json evaluation files")
    return {"workdir": workdir, "algorithm": str(manifest["algorithm"]),
            "evals": {it: cis for it, (cis, _) in read.items()},
            "per_question": {it: terms for it, (_, terms) in read.items()},
            "reward_mean": _reward_curve(workdir)}


def _labels(runs: Sequence[dict]) -> list:
    """The algorithm name; the workdir basename where algorithms repeat; the path if that repeats."""
    algos = Counter(r["algorithm"] for r in runs)
    labels = [r["algorithm"] if algos[r["algorithm"]] == 1
              else os.path.basename(os.path.normpath(r["workdir"])) for r in runs]
    counts = Counter(labels)
    return [lab if counts[lab] == 1 else os.path.normpath(r["workdir"]) for lab, r in zip(labels, runs)]


def comparison(runs: Sequence[dict], start_label: str = "sft (warm start)") -> dict:
    """The table's rows (the reference first: iteration 0 of the first run that has one, labelled
    `start_label`) and each method's curves, as plain numbers. A method's row holds its paired
    difference from the reference ("vs_warm_start") and, where its own iteration 0 is another
    policy (a run started elsewhere), from that too ("vs_own_start": what its updates gained)."""
    rows, curves = [], []
    warm = next((r for r in runs if 0 in r["evals"]), None)
    if warm is not None:
        rows.append({"method": start_label, "workdir": warm["workdir"], "iterations": 0, **warm["evals"][0]})
    for label, run in zip(_labels(runs), runs):
        last = max(run["evals"])
        curves.append({"method": label, "iterations": sorted(run["evals"]),
                       **{m: [run["evals"][i][m] for i in sorted(run["evals"])] for m in PAPER_METRICS},
                       "reward_mean": run["reward_mean"]})
        if run is warm and last == 0:  # the reference row already
            continue
        rows.append({"method": label, "workdir": run["workdir"], "iterations": last, **run["evals"][last]})
        if warm is not None:
            paired = _paired(warm["per_question"][0], run["per_question"][last], PAPER_METRICS)
            if any(paired.values()):
                rows[-1]["vs_warm_start"] = paired
        own = run["per_question"].get(0)
        if last > 0 and own and warm is not None and own != warm["per_question"][0]:
            paired = _paired(own, run["per_question"][last], PAPER_METRICS)
            if any(paired.values()):
                rows[-1]["vs_own_start"] = paired
    return {"rows": rows, "curves": curves}


def _cell(ci: dict) -> str:
    if ci["value"] is None:  # nothing to measure (e.g. no episode had the denominator)
        return "n/a"
    return f"{ci['value']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"


def _series(cis: Sequence[dict], key: str) -> list:
    return [float("nan") if c[key] is None else c[key] for c in cis]


def markdown_table(rows: Sequence[dict]) -> str:
    head = ["method", "iterations", *(TITLES[m] for m in PAPER_METRICS)]
    cells = [[row["method"], str(row["iterations"]), *(_cell(row[m]) for m in PAPER_METRICS)] for row in rows]
    return "\n".join(markdown_rows(head, cells)) + "\n"


def paired_table(rows: Sequence[dict], key: str = "vs_warm_start",
                 title: str = "Difference from the reference") -> str:
    """The methods' differences (`key`: from the reference, or from their own iteration 0) on the
    same questions ("" if there are none)."""
    paired = [row for row in rows if row.get(key)]
    if not paired:
        return ""
    head = ["method", "questions", *(TITLES[m] for m in PAPER_METRICS)]
    cells = [[row["method"], str(max(d["n"] for d in row[key].values() if d)),
              *(diff_cell(row[key][m], " *") for m in PAPER_METRICS)] for row in paired]
    lines = [f"{title} on the same questions (paired bootstrap, 95%; * the interval excludes 0):", "",
             *markdown_rows(head, cells)]
    return "\n".join(lines) + "\n"


def plot(curves: Sequence[dict], path: str) -> None:
    """One panel per paper metric over eval iterations (interval as a band), plus train reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PAPER_METRICS) + 1, figsize=(4.2 * (len(PAPER_METRICS) + 1), 3.8))
    for i, curve in enumerate(curves):
        color, xs = f"C{i % 10}", curve["iterations"]
        for ax, metric in zip(axes, PAPER_METRICS):
            ax.plot(xs, _series(curve[metric], "value"), marker="o", color=color, label=curve["method"])
            ax.fill_between(xs, _series(curve[metric], "lo"), _series(curve[metric], "hi"),
                            color=color, alpha=0.2)
        if curve["reward_mean"]:
            steps, values = zip(*curve["reward_mean"])
            axes[-1].plot(steps, values, color=color, label=curve["method"])
    for ax, title in zip(axes, [*(TITLES[m] for m in PAPER_METRICS), "train-batch reward_mean"]):
        ax.set_title(title)
        ax.set_xlabel("iteration")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)


# ----------------------------------------------------------------------------- the policies of one run
def _fmt(ci, pct=True) -> str:
    if not ci or ci.get("value") is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.2f}")
    return f"{f(ci['value'])} [{f(ci['lo'])}, {f(ci['hi'])}]"


def policy_comparison(results: dict) -> dict:
    """Per policy: its CI metrics and the paired difference (policy - base) on shared questions."""
    base = results.get("base")
    out = {}
    for name, metrics in results.items():
        row = {m: metrics["ci"][m] for m in CI_METRICS}
        if base is not None and name != "base":
            row["diff_vs_base"] = _paired(base["ci"]["per_question"], metrics["ci"]["per_question"], CI_METRICS)
        row["episodes"] = metrics["episodes"]
        out[name] = row
    return out


def policy_markdown(table: dict) -> str:
    head = ["policy", "episodes", *(TITLES[m] for m in CI_METRICS)]
    lines = markdown_rows(head, [[name, str(row["episodes"]), *(_fmt(row[m], pct=m != "mean_actions") for m in CI_METRICS)]
                             for name, row in table.items()])
    diffs = [(n, r["diff_vs_base"]) for n, r in table.items() if "diff_vs_base" in r]
    if diffs:
        lines += ["", "Paired difference from base on the same held-out questions (95% bootstrap interval):", "",
                  *markdown_rows(["policy", *(TITLES[m] for m in CI_METRICS)],
                             [[name, *(diff_cell(d[m], " (excludes 0)") for m in CI_METRICS)] for name, d in diffs])]
    return "\n".join(lines) + "\n"


def write_policy_comparison(workdir: str, results: dict) -> dict:
    """`comparison.md`, `eval/comparison.json` and `curves.png` of the evaluated policies `results`
    ({name: evaluation metrics}, "base" the reference); returns the table."""
    table = policy_comparison(results)
    text = policy_markdown(table)
    write_text_atomic(os.path.join(workdir, "comparison.md"), text)
    write_json_atomic(os.path.join(workdir, "eval", "comparison.json"), table)
    training_curves_png(workdir, results, os.path.join(workdir, "curves.png"))
    print(text)
    return table


def training_curves_png(workdir: str, results: dict, path: str) -> None:
    """Reward, KL, clip fraction and loss over updates per training stage, and the eval metrics
    of each policy (base at step 0, trained policies at their last update)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = read_metrics(workdir)
    panels = [("reward", "reward"), ("kl", "approx_kl"), ("clip fraction", "clipfrac"), ("loss", "loss")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4 * (len(panels) + 1), 3.6))
    for ax, (title, key) in zip(axes, panels):
        for stage, rows in logs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=stage)
        ax.set_title(title)
        ax.set_xlabel("update")
        if ax.lines:
            ax.legend(fontsize=7)
    ax = axes[-1]
    last = {stage: rows[-1]["step"] for stage, rows in logs.items() if rows}
    for m in ("accuracy", "process_correctness"):
        xs, ys, errs = [], [], []
        for name, metrics in results.items():
            ci = metrics["ci"][m]
            if ci.get("value") is None:
                continue
            xs.append(0 if name == "base" else last.get(name, 0))
            ys.append(ci["value"])
            errs.append([[ci["value"] - ci["lo"]], [ci["hi"] - ci["value"]]])
        for x, y, e in zip(xs, ys, errs):
            ax.errorbar([x], [y], yerr=e, fmt="o", capsize=3, color="C0" if m == "accuracy" else "C1")
        ax.plot([], [], "o", color="C0" if m == "accuracy" else "C1", label=TITLES[m])
    ax.set_title("eval (95% CI)")
    ax.set_xlabel("update")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure_atomic(fig, path)


# ----------------------------------------------------------------------------- the command line
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m steprl_jax.evaluation.compare",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    parser.add_argument("--out", default="comparison", help="path prefix of the .md/.json/.png outputs")
    parser.add_argument("--start-label", default="sft (warm start)",
                        help="the reference row's name: iteration 0 of the first WORKDIR that has one")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(w) for w in args.workdirs]
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = comparison(runs, args.start_label)
    table = markdown_table(result["rows"])
    for paired in (paired_table(result["rows"], "vs_warm_start", f"Difference from the reference ({args.start_label})"),
                   paired_table(result["rows"], "vs_own_start", "Difference from the run's own iteration 0")):
        if paired:
            table += "\n" + paired
    print(table, end="")
    write_text_atomic(args.out + ".md", table)
    write_json_atomic(args.out + ".json", result)
    plot(result["curves"], args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
