"""Judges built from config dicts; rule judges behind the model-judge interface; items from records."""
import pytest

from steprl_jax.agents.records import Step, Trajectory
from steprl_jax.judges.backends import CachedBackend
from steprl_jax.judges.factory import build_judge
from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.items import OutcomeItem, StepItem, TrajectoryItem, outcome_item, step_items, trajectory_item
from steprl_jax.judges.model_judges import OutcomeJudge, TrajectoryVerdictJudge
from steprl_jax.judges.rule_judges import RuleOutcomeJudge, RuleProcessJudge, RuleTrajectoryJudge


def test_rule_judges_from_config():
    process = build_judge({"kind": "rule", "base_url": "", "model": "", "votes": 1}, "process")
    assert isinstance(process, RuleProcessJudge)
    good, bad = process.judge_steps([
        StepItem("What is 12 times 4?", "", "<math_exp>12 * 4</math_exp>"),
        StepItem("What is 12 times 4?", "", "I think it is 48"),
    ])
    assert good.label == "GOOD" and good.score == 1.0
    assert bad.label == "BAD" and bad.score == 0.0 and bad.raw  # the reasons

    outcome = build_judge({"kind": "rule", "partial_f1": 0.0}, "outcome", rule="gsm8k")
    assert isinstance(outcome, RuleOutcomeJudge) and outcome.partial_f1 is None
    assert [v.label for v in outcome.judge([OutcomeItem("q", "$48", "48"), OutcomeItem("q", None, "48")])] == \
        ["YES", "NO"]

    portool = build_judge({"kind": "rule", "rule": "toolworld"}, "trajectory")
    verdicts = portool.judge([
        TrajectoryItem("q", "", "21 C", final_answer="It is 21 C", tool_failed=False),
        TrajectoryItem("q", "", "21 C", final_answer="Sorry, I cannot get the weather", tool_failed=True),
        TrajectoryItem("q", "", None, final_answer="x"),
    ])
    assert [v.label for v in verdicts] == ["true", "unable_to_answer", None]
    assert verdicts[1].score == 0.0 and verdicts[2].failure_code == "no_reference"
    assert isinstance(portool, RuleTrajectoryJudge) and portool.stats.snapshot()["failed/no_reference"] == 1


def test_http_judges_from_config(tmp_path):
    judge = build_judge({"kind": "http", "base_url": "http://127.0.0.1:1/v1", "model": "m", "votes": 5,
                         "cache_dir": str(tmp_path), "api_key_env": "", "rule": ""}, "trajectory")
    assert isinstance(judge, TrajectoryVerdictJudge) and judge.votes == 5 and judge.temperature == 1.0
    assert isinstance(judge.backend, CachedBackend) and isinstance(judge.backend.backend, HttpChatBackend)
    judge = build_judge({"kind": "http", "base_url": "http://127.0.0.1:1/v1", "model": "m"}, "outcome")
    assert isinstance(judge, OutcomeJudge) and judge.temperature == 0.0


@pytest.mark.parametrize("config, role, message", [
    ({"kind": "http", "votez": 3}, "outcome", "unknown judge config key"),
    ({"kind": "oracle"}, "outcome", "kind must be one of"),
    ({"kind": "rule"}, "reward", "role must be one of"),
    ({"kind": "http", "model": "m"}, "outcome", "needs `base_url`"),
    ({"kind": "rule"}, "outcome", "needs `rule`"),
    ({"kind": "rule", "rule": "exact"}, "outcome", "unknown outcome rule"),
    ({"kind": "local"}, "outcome", "needs `model`"),
])
def test_bad_configs_name_the_culprit(config, role, message):
    with pytest.raises(ValueError, match=message):
        build_judge(config, role)


def test_items_from_a_record():
    trajectory = Trajectory(
        id="t", query_id="q", question="weather in Paris?", prompt_text="", prompt_ids=[],
        steps=[Step("<think>a</think><tool_call>[...]</tool_call>", [], [], observation_text="ignored",
                    tool_results=[{"name": "weather", "error": {"type": "tool_failure", "message": "down"}}]),
               Step("<think>b</think><tool_call>[response_gen]</tool_call>", [], [])],
        reference_answer="sunny", final_answer="I could not get it")
    steps = step_items(trajectory)
    assert [s.action for s in steps] == [trajectory.steps[0].action_text, trajectory.steps[1].action_text]
    assert steps[0].history == [] and "tool_failure" in steps[1].history[1]["content"]
    item = trajectory_item(trajectory)
    assert item.tool_failed and item.reference == "sunny" and item.final_answer == "I could not get it"
    assert len(item.trajectory) == 3
    assert outcome_item(trajectory) == OutcomeItem("weather in Paris?", "I could not get it", "sunny")


def test_build_backend_as_the_main_job_calls_it(tmp_path):
    from steprl_jax.judges import build_backend

    backend = build_backend({"kind": "http", "base_url": "http://127.0.0.1:1/v1", "model": "m",
                             "api_key_env": "", "votes": 3}, cache_dir=str(tmp_path))
    assert isinstance(backend, CachedBackend) and backend.cache.root == str(tmp_path)
    with pytest.raises(ValueError, match="no chat backend"):
        build_backend({"kind": "rule"})
