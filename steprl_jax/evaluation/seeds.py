"""Results over several seeds: per-seed values, the seed mean, and bootstrap intervals over
questions and seeds together; a table of rows (policies) and metrics from their evaluations.

    python -m steprl_jax.evaluation.seeds --seeds 0 1 2 --reference base \\
        --row "base=runs/reproduce/swirl/arithmetic/seed{seed}/base/eval/base.json" \\
        --row "SWiRL (process)=runs/reproduce/swirl/arithmetic/seed{seed}/process/eval/swirl.json" \\
        --metrics accuracy process_correctness --out runs/reproduce/swirl/arithmetic/table

Each row's path names one evaluation per seed (`{seed}` is replaced; a path without it is one
evaluation shared by every seed, e.g. a base model evaluated greedily: the table's seeds column
says "shared"). An evaluation is a metrics JSON of `evaluation.runner.evaluate` whose "ci" holds
"per_question" terms. Rows missing some seeds are reported over the seeds they have, and say so.

The intervals resample the held-out questions and the seeds (a two-level bootstrap: a seed's
training run and the questions are both random draws); a difference between two rows pairs them
by question and by seed, the same draws for both. With one seed this is the question bootstrap of
`stats.paired_diff_ci`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from steprl_jax.evaluation.stats import DRAWS, diff_cell
from steprl_jax.io import write_json_atomic, write_text_atomic

Terms = Mapping[str, Sequence[float]]  # question id -> (numerator, denominator) summed over its episodes


def _matrices(by_seed: Mapping[int, Terms], questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(numerators, denominators) as (seeds, questions) arrays."""
    rows = [by_seed[s] for s in sorted(by_seed)]
    num = np.asarray([[r[q][0] for q in questions] for r in rows], np.float64)
    den = np.asarray([[r[q][1] for q in questions] for r in rows], np.float64)
    return num, den


def _ratios(num: np.ndarray, den: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per draw and seed, the ratio of sums over the drawn questions: (draws, seeds)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (counts @ num.T) / (counts @ den.T)


def _seed_mean(values: np.ndarray, seed_counts: np.ndarray) -> np.ndarray:
    """Mean over the drawn seeds of (draws, seeds) values, seeds without a value left out."""
    valid = ~np.isnan(values)
    weights = seed_counts * valid
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.where(valid, values, 0.0) * weights).sum(1) / weights.sum(1)


def _draws(n_questions: int, n_seeds: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    questions = rng.multinomial(n_questions, np.full(n_questions, 1.0 / n_questions), size=DRAWS).astype(np.float64)
    seeds = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=DRAWS).astype(np.float64)
    return questions, seeds


def _interval(draws: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def seeds_ci(by_seed: Mapping[int, Terms], *, seed: int = 0, level: float = 0.95) -> Optional[dict]:
    """The seed mean of a ratio metric (each seed's sum(num) / sum(den) over the questions all its
    seeds hold), each seed's value, and a two-level bootstrap interval. None without data."""
    if not by_seed:
        return None
    questions = sorted(set.intersection(*(set(t) for t in by_seed.values())))
    if not questions:
        return None
    num, den = _matrices(by_seed, questions)
    full = _ratios(num, den, np.ones((1, len(questions))))[0]
    if np.isnan(full).all():
        return None
    question_counts, seed_counts = _draws(len(questions), len(by_seed), seed)
    lo, hi = _interval(_seed_mean(_ratios(num, den, question_counts), seed_counts), level)
    return {"value": float(np.nanmean(full)), "lo": lo, "hi": hi,
            "per_seed": {str(s): (None if np.isnan(v) else float(v)) for s, v in zip(sorted(by_seed), full)},
            "seeds": len(by_seed), "questions": len(questions)}


def paired_seeds_diff_ci(a: Mapping[int, Terms], b: Mapping[int, Terms], *, seed: int = 0,
                         level: float = 0.95) -> Optional[dict]:
    """b - a over the seeds both hold, paired by seed and question: seed s of b against seed s of
    a. An evaluation shared by every seed (a base model) is held under each seed (`read_row`); a
    run with fewer seeds so far pairs with those only, never with another seed. None when
    nothing pairs."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    a, b = {s: a[s] for s in seeds}, {s: b[s] for s in seeds}
    questions = sorted(set.intersection(*(set(t) for t in (*a.values(), *b.values()))))
    if not questions:
        return None
    (na, da), (nb, db) = _matrices(a, questions), _matrices(b, questions)
    ones = np.ones((1, len(questions)))
    full = (_ratios(nb, db, ones) - _ratios(na, da, ones))[0]
    if np.isnan(full).all():
        return None
    question_counts, seed_counts = _draws(len(questions), len(seeds), seed)
    draws = _seed_mean(_ratios(nb, db, question_counts) - _ratios(na, da, question_counts), seed_counts)
    lo, hi = _interval(draws, level)
    return {"value": float(np.nanmean(full)), "lo": lo, "hi": hi,
            "per_seed": {str(s): (None if np.isnan(v) else float(v)) for s, v in zip(seeds, full)},
            "seeds": len(seeds), "questions": len(questions), "excludes_zero": bool(lo > 0 or hi < 0)}


# ----------------------------------------------------------------------------- a table of rows
def read_row(pattern: str, seeds: Sequence[int]) -> dict[int, dict]:
    """{seed: evaluation metrics} of a row: `pattern` with `{seed}` per seed (missing files left
    out), or one file shared by every seed."""
    paths = {s: pattern.format(seed=s) for s in seeds} if "{seed}" in pattern else {s: pattern for s in seeds}
    out = {}
    for s, path in paths.items():
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                metrics = json.load(f)
            except ValueError as error:
                raise ValueError(f"{path}: malformed JSON ({error})") from None
        if not isinstance(metrics, dict) or not isinstance(metrics.get("ci", {}).get("per_question"), dict):
            raise ValueError(f"{path}: not an evaluation's metrics (no 'ci' -> 'per_question' terms)")
        out[s] = metrics
    return out


def _terms(evaluations: Mapping[int, dict], metric: str) -> dict[int, Terms]:
    return {s: {q: t[metric] for q, t in m["ci"]["per_question"].items() if metric in t}
            for s, m in evaluations.items()}


def seed_table(rows: Mapping[str, Mapping[int, dict]], metrics: Sequence[str], reference: Optional[str] = None,
               *, seed: int = 0) -> dict:
    """{row: {metric: seeds_ci, "diff": {metric: paired_seeds_diff_ci vs reference}, "seeds": [...]}}."""
    table = {}
    for name, evaluations in rows.items():
        row = {"seeds": sorted(evaluations)}
        for metric in metrics:
            row[metric] = seeds_ci(_terms(evaluations, metric), seed=seed)
        if reference is not None and name != reference and rows.get(reference):
            row["diff"] = {m: paired_seeds_diff_ci(_terms(rows[reference], m), _terms(evaluations, m), seed=seed)
                           for m in metrics}
        table[name] = row
    return table


def pair_table(rows: Mapping[str, Mapping[int, dict]], pairs: Sequence[tuple[str, str]], metrics: Sequence[str],
               *, seed: int = 0) -> dict:
    """{"A vs B": {metric: paired_seeds_diff_ci of A - B}} for named pairs of rows (e.g. SWiRL
    against SFT trained on the same units)."""
    return {f"{a} vs {b}": {m: paired_seeds_diff_ci(_terms(rows[b], m), _terms(rows[a], m), seed=seed)
                            for m in metrics} for a, b in pairs}


def _cell(ci: Optional[dict], pct: bool, shared: bool = False) -> str:
    """Value [interval] (per-seed values); a shared row's one evaluation has no per-seed values."""
    if ci is None:
        return "n/a"
    f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.2f}")
    cell = f"{f(ci['value'])} [{f(ci['lo'])}, {f(ci['hi'])}]"
    if shared:
        return cell
    return cell + " (" + ", ".join("-" if v is None else f(v) for v in ci["per_seed"].values()) + ")"


def table_markdown(table: Mapping[str, dict], metrics: Sequence[str], titles: Mapping[str, str],
                   reference: Optional[str] = None, percent: Sequence[str] = (),
                   pairs: Optional[Mapping[str, dict]] = None) -> str:
    """Values (percent for `percent` metrics) with their intervals and per-seed values, then each
    row's paired difference from `reference`, then the named `pairs` (`pair_table`). A row marked
    "shared" (one evaluation for every seed) says so in place of its number of seeds."""
    from steprl_jax.evaluation.compare import markdown_rows

    titles_ = [titles.get(m, m) for m in metrics]
    lines = markdown_rows(["policy", "seeds", *titles_],
                          [[name, "shared" if row.get("shared") else str(len(row["seeds"])),
                            *(_cell(row[m], m in percent, row.get("shared", False)) for m in metrics)]
                           for name, row in table.items()])
    diffs = [(name, row["diff"]) for name, row in table.items() if "diff" in row]
    if diffs:
        lines += ["", f"Paired difference from {reference} (same questions, same seeds; 95% interval over "
                  "questions and seeds; * excludes 0):", "",
                  *markdown_rows(["policy", *titles_], [[name, *(diff_cell(d[m], " *") for m in metrics)]
                                                        for name, d in diffs])]
    if pairs:
        lines += ["", "Paired differences, first row minus second (same questions, same seeds; * excludes 0):", "",
                  *markdown_rows(["pair", *titles_], [[name, *(diff_cell(d[m], " *") for m in metrics)]
                                                      for name, d in pairs.items()])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from steprl_jax.evaluation.compare import TITLES

    parser = argparse.ArgumentParser(prog="python -m steprl_jax.evaluation.seeds", description=__doc__.split("\n")[0])
    parser.add_argument("--row", action="append", required=True, metavar="NAME=PATH",
                        help="a row: its name and its evaluations' path, {seed} for the seed")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--metrics", nargs="+", default=["accuracy"])
    parser.add_argument("--percent", nargs="*", default=None,
                        help="metrics shown in percent (default: all but mean_actions and the PORTool counts)")
    parser.add_argument("--reference", default=None, help="the row the others are paired against")
    parser.add_argument("--pair", action="append", default=[], metavar="'A vs B'",
                        help="also the paired difference A - B of two rows")
    parser.add_argument("--out", required=True, help="path prefix of the .md and .json outputs")
    args = parser.parse_args(argv)
    rows, shared = {}, set()
    for spec in args.row:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or not pattern:
            parser.error(f"--row {spec!r}: expected NAME=PATH")
        rows[name] = read_row(pattern, args.seeds)
        if "{seed}" not in pattern:  # one evaluation stands for every seed: not to be counted as several
            shared.add(name)
    if args.reference is not None and args.reference not in rows:
        parser.error(f"--reference {args.reference!r} is not a row ({', '.join(rows)})")
    pairs = [tuple(p.split(" vs ")) for p in args.pair]
    for spec, pair in zip(args.pair, pairs):
        if len(pair) != 2 or any(name not in rows for name in pair):
            parser.error(f"--pair {spec!r}: expected 'A vs B' with A and B rows ({', '.join(rows)})")
    percent = args.percent if args.percent is not None else \
        [m for m in args.metrics if m not in ("mean_actions", "tool_steps", "format_reward")]
    table = seed_table(rows, args.metrics, args.reference)
    for name in shared:
        if table[name]["seeds"]:
            table[name]["shared"] = True
    paired = pair_table(rows, pairs, args.metrics)
    text = table_markdown(table, args.metrics, TITLES, args.reference, percent, paired)
    write_text_atomic(args.out + ".md", text)
    write_json_atomic(args.out + ".json", {"seeds": args.seeds, "metrics": args.metrics, "rows": table,
                                           "pairs": paired})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
