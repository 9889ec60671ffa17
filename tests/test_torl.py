"""ToRL: the code action format (tools/code_format.py), its environment run by the rollout engine with
the real Python sandbox (agents/code_env.py), math-verify's outcome rule, the online loop's format
check and one online iteration of `algorithm=torl` on a tiny random policy.

Actions are written by hand and tokenised with SmolLM2's tokenizer, then handed to the rollout
engine's host step (`RolloutEngine._act`: parse, budget, sandbox, observation, settle) as the sampler
would hand them over; nothing is stubbed."""
import json
import os

import numpy as np
import pytest

from steprl_jax.agents.code_env import CodeEnv, response_answer
from steprl_jax.agents.environments import Task
from steprl_jax.agents.records import TreeRecord, Trajectory
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.algorithms import online
from steprl_jax.algorithms.tree_rows import leaf_rows
from steprl_jax.judges import rules
from steprl_jax.tools import code_format
from steprl_jax.tools.python_sandbox import SandboxSettings, python_tool
from steprl_jax.tools.registry import ToolRegistry
from rl_helpers import act_written, open_branch
from swirl_helpers import smol_tokenizer, tiny_model

STOP = code_format.OUTPUT_STOP


# ---- parsing ------------------------------------------------------------------------------
def test_the_last_complete_block_before_the_stop_is_the_code():
    text = ("First try:\n```python\nprint(1)\n```\nBetter:\n```python\nx = 6 * 7\nprint(x)\n```\n" + STOP)
    action = code_format.parse_code_action(text)
    assert action.stopped and action.code == "x = 6 * 7\nprint(x)" and action.after_stop == ""
    # a block still open at the stop runs nothing, not even the complete one before it (ToRL)
    unfinished = code_format.parse_code_action("```python\nprint(1)\n```\n```python\nprint(2)\n" + STOP)
    assert unfinished.stopped and unfinished.code is None
    assert code_format.parse_code_action("no code at all\n" + STOP).code is None
    # a block after the stop string is not this action's request
    assert code_format.parse_code_action(STOP + "\n```python\nprint(3)\n```\n").code is None
    # text the stop's token carried past it
    assert code_format.parse_code_action("```python\nprint(1)\n```\n" + STOP + "\n").after_stop == "\n"


def test_an_action_without_the_stop_is_the_end_of_the_response_and_its_answer_is_the_last_box():
    action = code_format.parse_code_action("So it is \\boxed{3}, no: \\boxed{\\frac{144}{2}}.")
    assert not action.stopped and action.code is None and action.answer == "\\frac{144}{2}"
    assert code_format.last_boxed("\\boxed{\\text{a {b} c}} end") == "\\text{a {b} c}"
    assert code_format.last_boxed("the answer is 72") is None
    assert code_format.last_boxed("\\boxed{72} then cut \\boxed{7") == "72"  # an unclosed box is skipped
    assert code_format.last_boxed(None) is None


def test_outputs_are_shown_by_torl_rules():
    assert code_format.format_output("  42\n") == "42"
    # "Error" anywhere: the last line only
    assert code_format.format_output("Traceback\n  line 1\nZeroDivisionError: division by zero") == \
        "ZeroDivisionError: division by zero"
    long = "".join(str(i % 10) for i in range(300))
    shown = code_format.format_output(long)
    assert shown == long[:128] + "..." + long[-128:] and len(shown) == 259
    assert code_format.format_output("x" * 255) == "x" * 255
    assert code_format.format_output("") == ""  # not ToRL's timeout text
    assert code_format.render_observation("42") == "\n42\n```\n"
    assert code_format.render_observation("42", after_stop="\n") == "42\n```\n"


# ---- the environment in the rollout engine, with the real sandbox --------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


def _engine(tokenizer, max_tool_calls=1, max_steps=5, wall_timeout_s=2.0):
    settings = SandboxSettings(wall_timeout_s=wall_timeout_s, cpu_s=2)
    env = CodeEnv(ToolRegistry([python_tool(settings)]), max_tool_calls=max_tool_calls)
    # `act_written` never samples: the engine is given the sampler's actions by hand (no sampler needed)
    return RolloutEngine(None, tokenizer, env, RolloutConfig(max_steps=max_steps, max_new_tokens=64,
                                                            max_context=4096))


TASK = Task("q0", "What is 6 times 12?", "72")


def test_a_response_runs_its_block_continues_and_ends_at_the_end_of_turn(tokenizer):
    engine = _engine(tokenizer)
    try:
        branch, prompt_ids = open_branch(engine, TASK)
        first = act_written(engine, branch, "Multiply:\n```python\nprint(6 * 12)\n```\n" + STOP)
        assert first.kind == "code" and first.tool_calls == [{"name": "python", "arguments": {"code": "print(6 * 12)"}}]
        assert first.observation_text == "\n72\n```\n"
        assert first.observation_ids == tokenizer.encode("\n72\n```\n", add_special_tokens=False)
        assert not branch.done
        last = act_written(engine, branch, "So the answer is \\boxed{72}.", finish_reason="eos")
        assert last.kind == "answer" and last.observation_text == ""
        assert branch.done and branch.termination == "answer" and branch.final_answer == "72"
        text = "".join(s.action_text + s.observation_text for s in branch.steps)
        assert "```output\n72\n```\nSo the answer" in text  # the turn reads as ToRL's

        # the loss mask: the action tokens (```output included) train, the output's tokens do not
        trajectory = Trajectory("e0", TASK.id, TASK.question, "", prompt_ids, branch.steps, TASK.reference,
                                branch.final_answer, branch.termination)
        record = TreeRecord.from_group("t0", [trajectory])
        (row,) = leaf_rows(record, lambda leaf, node: 1.0, agg="token_mean")
        ids, loss = row.flat()[0], np.asarray(row.flat()[1])
        start = len(prompt_ids)
        spans = [(first.action_ids, True), (first.observation_ids, False), (last.action_ids, True)]
        for span_ids, trained in spans:
            assert ids[start:start + len(span_ids)] == list(span_ids)
            assert (loss[start:start + len(span_ids)] > 0).all() if trained else not loss[start:start + len(span_ids)].any()
            start += len(span_ids)
        assert not loss[:len(prompt_ids)].any()
    finally:
        engine.close()


def test_past_the_call_budget_a_stop_runs_nothing_and_the_text_goes_on(tokenizer):
    engine = _engine(tokenizer, max_tool_calls=1)
    try:
        branch, _ = open_branch(engine, TASK)
        act_written(engine, branch, "```python\nprint(1 + 1)\n```\n" + STOP)
        second = act_written(engine, branch, "\n2\n```\nAgain:\n```python\nprint(2 + 2)\n```\n" + STOP)
        assert second.kind == "text" and second.tool_calls == [] and second.tool_results == []
        assert second.observation_text == "" and second.observation_ids == [] and not branch.done
        # with no budget at all, the first request is not run either
        none = _engine(tokenizer, max_tool_calls=0)
        try:
            branch0, _ = open_branch(none, TASK)
            assert act_written(none, branch0, "```python\nprint(1)\n```\n" + STOP).kind == "text"
        finally:
            none.close()
    finally:
        engine.close()


@pytest.mark.parametrize("code, shown", [
    ("print(1 / 0)", "ZeroDivisionError: division by zero"),
    ("while True:\n    pass", "TimeoutError: the code did not finish within 1 s"),
    ("import os\nos.system('ls')", "PermissionError: sandbox: os.system is not allowed"),
])
def test_a_bad_snippet_is_an_error_observation_and_the_response_goes_on(tokenizer, code, shown):
    engine = _engine(tokenizer, max_tool_calls=2, wall_timeout_s=1.0)
    try:
        branch, _ = open_branch(engine, TASK)
        step = act_written(engine, branch, f"```python\n{code}\n```\n" + STOP)
        output = step.observation_text[1:-len(code_format.OUTPUT_END)]
        assert step.kind == "code" and shown in output and "\n" not in output  # the error's last line
        assert not branch.done
        again = act_written(engine, branch, "Fixed:\n```python\nprint(72)\n```\n" + STOP)
        assert again.observation_text == "\n72\n```\n"
    finally:
        engine.close()


def test_a_stop_without_a_block_is_an_error_and_a_response_cut_without_a_box_has_no_answer(tokenizer):
    engine = _engine(tokenizer)
    try:
        branch, _ = open_branch(engine, TASK)
        step = act_written(engine, branch, "I will write code later\n" + STOP)
        assert step.kind == "invalid" and "no complete ```python block" in step.observation_text
        assert step.observation_text.endswith("\n```\n") and not branch.done
        act_written(engine, branch, "The total is seventy", finish_reason="length")
        assert branch.done and branch.termination == "no_answer" and branch.final_answer is None
    finally:
        engine.close()


def test_the_worked_examples_show_what_the_sandbox_prints(tokenizer):
    """Each code-format demonstration's output is what its block prints when run, and the
    demonstration parses as a run followed by the boxed answer."""
    from steprl_jax.data.arithmetic import arithmetic_problems

    engine = _engine(tokenizer)
    try:
        for problem in arithmetic_problems(9, seed=10_007):  # every template, the division one included
            run, answer = problem.code_demonstration().steps
            branch, _ = open_branch(engine, Task(problem.id, problem.question, problem.answer))
            step = act_written(engine, branch, run.action)
            assert step.kind == "code" and step.observation_text == run.observation, problem.question
            assert code_format.parse_code_action(answer.action).answer == problem.answer
    finally:
        engine.close()


# ---- the outcome -----------------------------------------------------------------------------
@pytest.mark.parametrize("prediction, label", [
    ("72", "true"), ("72.0", "true"), ("\\frac{144}{2}", "true"), ("1,000", "false"), ("73", "false"),
    (None, "false"), ("", "false")])
def test_math_verify_outcome(prediction, label):
    assert rules.math_verify_outcome(prediction, "72") == label
    assert rules.OUTCOME_REWARD[label] == (1.0 if label == "true" else -1.0)  # ToRL's +1 / -1


def test_the_rule_judges_know_math_verify():
    from steprl_jax.judges.items import TrajectoryItem
    from steprl_jax.judges.rule_judges import OUTCOME_RULES, RuleTrajectoryJudge

    assert "math_verify" in OUTCOME_RULES
    item = TrajectoryItem(question="q", trajectory=(), reference="72", final_answer="\\frac{144}{2}")
    assert RuleTrajectoryJudge("math_verify").judge([item])[0].label == "true"


def test_the_answer_is_the_last_box_of_the_whole_response(tokenizer):
    from steprl_jax.agents.records import Step

    steps = [Step(action_text="Guess \\boxed{70}.\n```python\nprint(72)\n```\n" + STOP, action_ids=[1],
                  action_logprobs=[0.0], observation_text="\n72\n```\n"),
             Step(action_text="Done.", action_ids=[2], action_logprobs=[0.0])]
    trajectory = Trajectory("e", "q", "q", "", [0], steps, "72", None, "no_answer")
    assert response_answer(trajectory) == "70"  # the final action has no box: the earlier one counts
    steps[1] = Step(action_text="So \\boxed{72}.", action_ids=[2], action_logprobs=[0.0])
    assert response_answer(trajectory) == "72"


# ---- the online loop -------------------------------------------------------------------------
def _torl_config(tmp_path):
    from configs import torl_arithmetic

    c = torl_arithmetic.get_config()
    c.workdir = str(tmp_path)
    c.progress = False
    c.task.num_tasks = 4
    c.env.few_shot = 0
    c.env.python.wall_timeout_s = 2.0
    c.rollout.max_new_tokens = 12
    c.rollout.max_steps = 2
    c.rollout.max_context = 512
    c.rollout.tree.n = 2
    c.rl.iterations = 1
    c.rl.queries_per_iteration = 2
    c.rl.eval.num_tasks = 0
    # the random policy's responses all score -1: train anyway, to see the update run
    c.rl.skip_update_without_signal = False
    c.optimizer.learning_rate = 1e-3
    return c


def test_read_settings_refuses_a_method_on_a_format_it_does_not_train(tmp_path):
    from configs import portool_toolworld

    c = _torl_config(tmp_path)
    settings = online.read_settings(c)
    assert settings.algorithm.name == "torl" and settings.learner.loss.kl_coef == 0.0
    assert settings.method.eps_low == settings.method.eps_high == 0.2 and settings.method.agg == "token_mean"
    c.env.format = "tool_call"
    with pytest.raises(ValueError, match=r"config.env.format: torl trains on the code format; got 'tool_call'"):
        online.read_settings(c)
    p = portool_toolworld.get_config()
    p.env.format = "code"
    with pytest.raises(ValueError, match=r"config.env.format: portool trains on the tool_call format; got 'code'"):
        online.read_settings(p)


def test_the_code_format_needs_the_python_tool_and_a_math_task(tmp_path):
    from steprl_jax.agents.tasks import build_suite

    c = _torl_config(tmp_path)
    c.env.tools = ("calculator",)
    with pytest.raises(ValueError, match=r"config.env.tools: the code format runs \('python',\)"):
        build_suite(c)
    c = _torl_config(tmp_path)
    c.env.python.wall_timeout_s = 0.0
    with pytest.raises(ValueError, match="config.env.python.wall_timeout_s must be > 0"):
        build_suite(c)
    c = _torl_config(tmp_path)
    c.task.name = "toolworld"
    with pytest.raises(ValueError, match="config.env.format: the code format runs the math tasks"):
        build_suite(c)


def test_torl_trains_each_response_token_on_its_group_z_score(tmp_path):
    from steprl_jax.agents.records import Step
    from steprl_jax.algorithms.base import get_algorithm

    torl = get_algorithm("torl")
    settings = torl.read(_torl_config(tmp_path))
    loss = torl.loss(settings)
    assert (loss.eps_low, loss.eps_high, loss.kl_coef, loss.entropy_coef) == (0.2, 0.2, 0.0, 0.0)

    def steps():  # a code run (2 action tokens, 1 output token) then the answer (1 token)
        return [Step("a", [1, 2], [0.0, 0.0], observation_text="o", observation_ids=[3]), Step("b", [4], [0.0])]

    record = TreeRecord.from_group("t", [Trajectory(f"e{i}", "q", "q", "", [9, 9], steps(), "72") for i in range(4)])
    record.leaf_outcomes = {str(leaf): r for leaf, r in zip(record.leaves(), (1.0, -1.0, -1.0, -1.0))}
    rows, metrics = torl.build([record], settings)
    # rewards (1, -1, -1, -1): mean -0.5, sample std 1 (ddof 1): advantages 1.5 and -0.5, over (std + 1e-6)
    trained = [(w, a) for row in rows for w, a in zip(row.flat()[1], row.flat()[3]) if w > 0]
    assert len(trained) == 4 * 3 and {w for w, _ in trained} == {1.0}  # every action token, weight 1: token mean
    assert sorted(a for _, a in trained) == pytest.approx([-0.5 / (1 + 1e-6)] * 9 + [1.5 / (1 + 1e-6)] * 3)
    assert metrics["reward"] == -0.5


def test_one_online_iteration_of_torl(tmp_path):
    from steprl_jax import config_schema
    from steprl_jax.training.metrics_log import read_metrics

    c = _torl_config(tmp_path)
    c.rl.eval.num_tasks = 2  # the held-out evaluation judges the code format too
    config_schema.check(c)
    tokenizer = smol_tokenizer()
    summary = online.run(c, (tiny_model(tokenizer), tokenizer))
    assert summary["algorithm"] == "torl"
    row = read_metrics(str(tmp_path))["rl"][0]
    assert row["leaves"] == 4 and row["reward_mean"] == -1.0 and row["trained_tokens"] > 0
    assert row["first_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert os.listdir(tmp_path / "checkpoints" / "rl")
    with open(tmp_path / "rollouts" / "iter_00000.jsonl") as f:
        trees = [json.loads(line) for line in f]
    assert len(trees) == 2 and all(v["label"] == "false" for t in trees for v in t["leaf_verdicts"].values())
    with open(tmp_path / "eval" / "iter_00001.metrics.json") as f:
        evaluated = json.load(f)
    ci = evaluated["ci"]
    assert ci["accuracy"]["value"] == 0.0 and ci["accuracy"]["n"] == 2
    assert ci["format_reward"]["value"] is None and ci["process_correctness"]["value"] is None  # no R_fm, no tag judge
