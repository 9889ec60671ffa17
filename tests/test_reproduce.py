"""launch/reproduce.sh over kept results: a table grows over several machines.

Every run of a table whose results are kept under --results is restored and skipped (no model is
loaded, no run starts), and the tables are written from the kept files; a run without its kept
files is the only one that starts.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILTERS = ("none", "process", "outcome", "process_outcome", "process_step")
PORTOOL_METHODS = ("portool", "grpo", "grpo_fm", "dapo", "arpo", "arpo_fm", "gigpo", "tree_grpo",
                   "portool_gamma0.9", "portool_gamma1.0")


def _evaluation(path, correct, metrics=("accuracy",), questions=8):
    """An evaluation's metrics file: `correct` of `questions` answered right, for each metric."""
    per_question = {f"q{i}": {m: [float(i < correct), 1.0] for m in metrics} for i in range(questions)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"accuracy": correct / questions, "ci": {"per_question": per_question}}, f)


def _reproduce(table, tmp_path, *args):
    env = {**os.environ, "NO_VENV": "1", "CURVE": "", "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ["PATH"]}
    return subprocess.run(["bash", os.path.join(ROOT, "launch", "reproduce.sh"), table, "--seeds", "0", "1",
                           "--root", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def _started_runs(tmp_path):
    return sorted(os.path.relpath(d, tmp_path / "runs") for d, _, files in os.walk(tmp_path / "runs")
                  if "main.log" in files)


def test_swirl_runs_kept_under_results_are_skipped_and_tabled(tmp_path):
    kept = tmp_path / "results" / "swirl"
    for task in ("arithmetic", "gsm8k"):
        _evaluation(f"{kept}/{task}/base/eval/base.json", 1)
        for seed in (0, 1):
            for rank, filter_ in enumerate(FILTERS):
                _evaluation(f"{kept}/{task}/seed{seed}/{filter_}/eval/sft.json", 2)
                _evaluation(f"{kept}/{task}/seed{seed}/{filter_}/eval/swirl.json", 3 + rank + seed)
    for pair in ("arithmetic_on_gsm8k", "gsm8k_on_arithmetic"):
        for seed in (0, 1):
            _evaluation(f"{kept}/transfer/{pair}/seed{seed}/eval/swirl.json", 2)
    out = _reproduce("swirl", tmp_path)
    assert out.returncode == 0, out.stderr
    assert _started_runs(tmp_path) == []  # nothing ran: no model loaded anywhere
    table = json.loads((kept / "arithmetic" / "table.json").read_text())["rows"]
    assert table["SWiRL (process_step)"]["accuracy"]["per_seed"] == {"0": 7 / 8, "1": 8 / 8}
    assert table["SWiRL (none)"]["diff"]["accuracy"]["value"] == pytest.approx((2 + 3) / 2 / 8)
    pairs = json.loads((kept / "arithmetic" / "table.json").read_text())["pairs"]
    assert pairs["SWiRL (outcome) vs SFT (outcome)"]["accuracy"]["value"] == pytest.approx((5 + 6) / 2 / 8 - 2 / 8)
    assert pairs["SWiRL (process) vs SWiRL (process_step)"]["accuracy"]["value"] == pytest.approx(-3 / 8)
    transfer = json.loads((kept / "transfer" / "gsm8k_on_arithmetic.json").read_text())["rows"]
    assert transfer["SWiRL trained on gsm8k"]["accuracy"]["value"] == 2 / 8
    assert transfer["SWiRL trained on arithmetic"]["accuracy"]["per_seed"] == {"0": 4 / 8, "1": 5 / 8}
    assert not (kept / "arithmetic" / "curve.md").exists()  # CURVE="": no curve, no curve table
    # restored into the workdirs, as a resumed run would have them
    assert (tmp_path / "runs" / "swirl" / "gsm8k" / "seed1" / "outcome" / "eval" / "swirl.json").exists()


def test_filters_runs_only_those_named_and_tables_every_filter(tmp_path):
    kept = tmp_path / "results" / "swirl"
    for task in ("arithmetic", "gsm8k"):
        _evaluation(f"{kept}/{task}/base/eval/base.json", 1)
        for seed in (0, 1):
            for filter_ in FILTERS:
                if (seed, filter_) != (1, "outcome"):  # seed 1's outcome run is missing: not run
                    _evaluation(f"{kept}/{task}/seed{seed}/{filter_}/eval/sft.json", 2)
                    _evaluation(f"{kept}/{task}/seed{seed}/{filter_}/eval/swirl.json", 3)
    for pair in ("arithmetic_on_gsm8k", "gsm8k_on_arithmetic"):
        for seed in (0, 1):
            _evaluation(f"{kept}/transfer/{pair}/seed{seed}/eval/swirl.json", 2)
    out = _reproduce("swirl", tmp_path, "--filters", "process", "none")
    assert out.returncode == 0, out.stderr
    assert _started_runs(tmp_path) == []
    table = json.loads((kept / "gsm8k" / "table.json").read_text())["rows"]
    assert table["SWiRL (outcome)"]["seeds"] == [0] and table["SWiRL (process)"]["seeds"] == [0, 1]


def test_portool_runs_kept_under_results_are_skipped_and_no_warm_start_is_made(tmp_path):
    kept = tmp_path / "results" / "portool"
    metrics = ("accuracy", "tool_steps", "unanswerable", "format_reward")
    _evaluation(f"{kept}/warm_start/eval/iter_00000.metrics.json", 2, metrics)
    for seed in (0, 1):
        for rank, method in enumerate(PORTOOL_METHODS):
            _evaluation(f"{kept}/{method}/seed{seed}/eval/iter_00008.metrics.json", rank % 6 + 2, metrics)
    out = _reproduce("portool", tmp_path)
    assert out.returncode == 0, out.stderr
    assert _started_runs(tmp_path) == [] and not (tmp_path / "runs" / "portool" / "warm_start").exists()
    table = json.loads((kept / "table.json").read_text())["rows"]
    assert table["SFT (warm start)"]["accuracy"]["value"] == 2 / 8
    assert table["dapo"]["diff"]["accuracy"]["value"] == pytest.approx(3 / 8)
    assert json.loads((kept / "table.json").read_text())["pairs"]["grpo_fm vs grpo"]["accuracy"]["value"] == 1 / 8
    vs_grpo = json.loads((kept / "vs_grpo.json").read_text())["rows"]
    assert "SFT (warm start)" not in vs_grpo and vs_grpo["portool"]["diff"]["accuracy"]["value"] == -1 / 8
    vs_portool = json.loads((kept / "vs_portool.json").read_text())["rows"]
    assert vs_portool["tree_grpo"]["diff"]["accuracy"]["value"] == pytest.approx((3 - 2) / 8)


def test_tables_only_runs_nothing_and_tables_what_is_kept(tmp_path):
    kept = tmp_path / "results" / "portool"
    metrics = ("accuracy", "tool_steps", "unanswerable", "format_reward")
    _evaluation(f"{kept}/warm_start/eval/iter_00000.metrics.json", 2, metrics)
    _evaluation(f"{kept}/portool/seed1/eval/iter_00008.metrics.json", 5, metrics)  # nothing else has run
    _evaluation(f"{kept}/portool/seed2/eval/iter_00008.metrics.json", 6, metrics)  # an earlier `--seeds 2`
    out = _reproduce("portool", tmp_path, "--tables-only")  # --seeds 0 1
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "runs").exists()
    table = json.loads((kept / "table.json").read_text())["rows"]
    # every seed on record is tabled, not only the invocation's
    assert table["portool"]["seeds"] == [1, 2] and table["grpo"]["seeds"] == []


def test_methods_runs_only_those_named_and_tables_every_method(tmp_path):
    kept = tmp_path / "results" / "portool"
    metrics = ("accuracy", "tool_steps", "unanswerable", "format_reward")
    _evaluation(f"{kept}/warm_start/eval/iter_00000.metrics.json", 2, metrics)
    for seed in (0, 1):
        for method in ("portool", "grpo"):
            _evaluation(f"{kept}/{method}/seed{seed}/eval/iter_00008.metrics.json", 3, metrics)
    _evaluation(f"{kept}/dapo/seed0/eval/iter_00008.metrics.json", 4, metrics)
    out = _reproduce("portool", tmp_path, "--methods", "portool", "grpo")  # DAPO's seed 1 is missing: not run
    assert out.returncode == 0, out.stderr
    assert _started_runs(tmp_path) == [] and not (tmp_path / "runs" / "portool" / "warm_start").exists()
    table = json.loads((kept / "table.json").read_text())["rows"]
    assert table["dapo"]["seeds"] == [0] and table["grpo"]["seeds"] == [0, 1]


@pytest.mark.parametrize("table, args, message", [
    ("portool", ["--methods", "ppo"], "reproduce.sh: unknown method 'ppo' for --methods (portool grpo"),
    ("portool", ["--methods", "--seeds", "0"], "reproduce.sh: --methods needs at least one name"),
    ("swirl", ["--methods", "portool"], "reproduce.sh: --methods applies to the portool table only"),
    ("swirl", ["--filters", "oracle"], "reproduce.sh: unknown filter 'oracle' for --filters (none process"),
    ("portool", ["--filters", "process"], "reproduce.sh: --filters applies to the swirl table only"),
])
def test_bad_methods_and_filters_are_named_before_anything_runs(tmp_path, table, args, message):
    out = _reproduce(table, tmp_path, *args)
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr
    assert not (tmp_path / "runs").exists()
