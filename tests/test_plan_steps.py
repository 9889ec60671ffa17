"""Tool-call steps against the tool world's reference plans, on a kept evaluation (the PORTool
table's warm start: results/reproduce/portool) and on hand-made records."""
import gzip
import json
import os

import pytest

from configs import portool_toolworld
from steprl_jax.errors import ConfigError
from steprl_jax.evaluation.plan_steps import main, steps_against_plans
from steprl_jax.io import DataFormatError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM_START = os.path.join(ROOT, "results/reproduce/portool/portool/seed0/eval/iter_00000.trajectories.jsonl.gz")


def _config(num_tasks=256):
    c = portool_toolworld.get_config()
    c.task.num_tasks, c.task.eval_num_tasks = num_tasks, 96
    return c


def test_the_warm_starts_evaluation_against_its_plans(tmp_path):
    out = main(_config(), [WARM_START], str(tmp_path / "steps.json"))[WARM_START]
    # the README's reading: no episode takes more steps than its plan; the short ones are wrong
    assert (out["all"]["n"], out["all"]["fewer"], out["all"]["more"], out["correct"]["n"]) == (96, 31, 0, 41)
    assert out["all"]["steps"] == pytest.approx(2.28, abs=0.005)  # the table's tool-call steps
    assert json.loads((tmp_path / "steps.json").read_text())[WARM_START] == out


def _record(query_id, steps, label):
    return {"query_id": query_id, "steps": steps, "judgements": {"outcome": {"label": label}}}


def test_counts_by_hand():
    call, think, answer = {"tool_calls": [{"name": "f"}], "kind": "action"}, {"kind": "action"}, {"kind": "answer"}
    records = [_record("a", [call, answer], "true"),  # as planned
               _record("a", [answer], "false"),  # answered before the call it needed
               _record("b", [think, call, call, answer], "false")]  # one call more than the plan
    out = steps_against_plans(records, {"a": 2, "b": 2})
    assert out["all"] == {"n": 3, "steps": 2.0, "plan_steps": 2.0, "fewer": 1, "more": 1}
    assert (out["correct"]["n"], out["wrong"]["steps"]) == (1, 2.0)


def test_queries_of_another_set_are_named():
    with pytest.raises(ConfigError, match=r"eval.jsonl: 1 query ids are not among the config's 2 queries \(first: 'c'\)"):
        steps_against_plans([_record("c", [], "true")], {"a": 2, "b": 2}, "eval.jsonl")


def test_a_torn_line_is_named_with_its_file_and_line(tmp_path):
    path = str(tmp_path / "eval.trajectories.jsonl.gz")
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(_record("a", [], "true")) + "\n" + '{"query_id": "b", "st' + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:2"):
        main(_config(), [path])
