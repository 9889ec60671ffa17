"""The reference-guided step judge (judges/rules.judge_step_against_solution): hand-computed
verdicts on real GSM8K and built-in arithmetic problems, its place beside the process judge in
`Judging` and evaluation metrics, and `judge.process.kind=reference` as an opt-in process judge."""
import pytest

from configs.demo import get_config
from steprl_jax.agents.records import Step, Trajectory
from steprl_jax.agents.tasks import build_suite
from steprl_jax.config_schema import check
from steprl_jax.data.arithmetic import arithmetic_problems
from steprl_jax.data.gsm8k import load_gsm8k
from steprl_jax.errors import ConfigError
from steprl_jax.evaluation.metrics import ci_metrics, episode_terms
from steprl_jax.judges import rules
from steprl_jax.judges.items import SolutionReference
from steprl_jax.judges.judging import Judging

GSM8K = "../shared/data/gsm8k/test_1000.jsonl"


def _janet():
    """GSM8K test row 0: 16 - 3 - 4 = <<16-3-4=9>>9 eggs, 9 * 2 = $<<9*2=18>>18; #### 18."""
    problem = load_gsm8k(GSM8K)[0]
    assert problem.question.startswith("Janet")
    return problem


def _verdict(kind, content, problem):
    return rules.judge_step_against_solution(kind, content, problem.solution_quantities(), problem.answer)


def test_a_gsm8k_problems_quantities_are_its_annotated_values_and_the_answer():
    assert _janet().solution_quantities() == ("9", "18")


@pytest.mark.parametrize("kind, content, good", [
    ("math", "16 - 3 - 4", True),        # the first gold step
    ("math", "16-7", True),              # another expression of the same quantity
    ("math", "(16 - 3 - 4) * 2", True),  # straight to the answer
    ("math", "9 * 2", True),
    ("math", "16 * 2", False),           # well formed, no quantity of the solution
    ("math", "16 - 3", False),           # a partial difference the solution never computes
    ("math", "16 - ", False),            # not an expression
    ("answer", "$18", True),
    ("answer", "18 dollars", True),
    ("answer", "9", False),
    ("search", "duck egg prices", False),
    (None, "", False),
])
def test_gsm8k_steps_by_hand(kind, content, good):
    verdict = _verdict(kind, content, _janet())
    assert verdict.good is good, verdict.reasons
    assert bool(verdict.reasons) is not good


def test_a_rounded_annotation_and_the_exact_value_both_count():
    # <<10/3=3.33>>: the annotation keeps 3.33, our calculator's 10/3 is exact; both are quantities
    quantities = ("3.33", "3.3333333333", "6.67")
    assert rules.judge_step_against_solution("math", "10/3", quantities, "6.67").good
    assert rules.judge_step_against_solution("math", "3.33", quantities, "6.67").good
    assert not rules.judge_step_against_solution("math", "3.3", quantities, "6.67").good


def test_an_arithmetic_problems_quantities_are_its_gold_steps_values():
    problem = next(p for p in arithmetic_problems(50, seed=0) if len(p.steps) >= 2)
    quantities = problem.solution_quantities()
    assert len(quantities) == len(problem.steps) and quantities[-1] == problem.answer
    for expression in problem.steps:
        assert rules.judge_step_against_solution("math", expression, quantities, problem.answer).good


def _config(**task):
    config = get_config()
    config.task.update(task)
    return config


def _trajectory(task, actions):
    steps = [Step(a, [], [], kind=k) for k, a in actions]
    return Trajectory(f"{task.id}#0", task.id, task.question, "", [], steps=steps, reference_answer=task.reference)


def test_judging_adds_the_reference_verdicts_beside_the_rule_process_judges():
    suite = build_suite(_config(name="gsm8k", path=GSM8K, num_tasks=1))
    task = suite.tasks[0]
    assert suite.solution_reference(task) == SolutionReference(("9", "18"), "18")
    judging = Judging(outcome_rule=suite.outcome_rule, solution_reference=suite.solution_reference)
    # 16 * 2 uses only numbers of the question: the rule judge (no answer) calls it GOOD, the
    # reference judge BAD; "16 - 3 - 4" is GOOD for both
    trajectory = _trajectory(task, [("math", "<math_exp>16 * 2</math_exp>"), ("math", "<math_exp>16 - 3 - 4</math_exp>"),
                                    ("answer", "<answer>32</answer>")])
    judging.judge([(task, trajectory)])
    rule = [v["label"] for v in trajectory.judgements["process"]]
    reference = [v["label"] for v in trajectory.judgements["reference_process"]]
    assert rule[:2] == ["GOOD", "GOOD"]
    assert reference == ["BAD", "GOOD", "BAD"]
    assert all(v["judge"] == "reference" for v in trajectory.judgements["reference_process"])
    terms = episode_terms(trajectory)
    assert terms["reference_process_correctness"] == (1.0, 3.0)
    assert terms["process_correctness"] == (float(rule.count("GOOD")), 3.0)
    ci = ci_metrics([trajectory])
    assert ci["reference_process_correctness"]["value"] == pytest.approx(1 / 3)


def test_reference_as_the_process_judge_is_an_opt_in_for_the_math_tasks():
    config = _config(name="arithmetic", num_tasks=2)
    config.judge.process.kind = "reference"
    check(config)  # the schema knows it
    suite = build_suite(config)
    judging = Judging.from_config(config, outcome_rule=suite.outcome_rule, solution_reference=suite.solution_reference)
    task = suite.tasks[0]
    trajectory = _trajectory(task, [("answer", f"<answer>{task.reference}</answer>")])
    judging.judge([(task, trajectory)])
    assert [v["label"] for v in trajectory.judgements["process"]] == ["GOOD"]
    assert trajectory.judgements["process"][0]["judge"] == "reference"
    with pytest.raises(ValueError, match="judge.process.kind=reference needs the math tasks"):
        Judging.from_config(config, outcome_rule=suite.outcome_rule)  # no reference solutions
    config.judge.process.kind = "oracle"
    with pytest.raises(ConfigError, match="judge.process.kind"):
        check(config)
