"""The SFT warm start of the code formats: expert rows of the math tasks' gold steps (ToRL's "code",
SimpleTIR's "code_turns"; built-in arithmetic and GSM8K) are token for token what the rollout engine
gives when those actions are sampled, with the real Python sandbox printing every output, and the
expert's answer is judged right by the format's outcome rule.

The expert's actions are handed to the engine's host step (`rl_helpers.act_written`) as the sampler
would hand them over; a final answer, which ends the turn, is sampled with its end-of-turn token."""
import pytest

from steprl_jax.agents.records import Trajectory
from steprl_jax.agents.rollout import RolloutEngine
from steprl_jax.agents.tasks import build_suite, rollout_config
from steprl_jax.algorithms.sft import expert_rows
from steprl_jax.models.chat import end_of_turn_id
from rl_helpers import act_written, open_branch
from swirl_helpers import smol_tokenizer

GSM8K = "../shared/data/gsm8k/train.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


def _config(method: str, task: str):
    from configs import simpletir_arithmetic, torl_arithmetic

    c = (torl_arithmetic if method == "torl" else simpletir_arithmetic).get_config()
    c.task.num_tasks = 6
    c.env.python.wall_timeout_s = 5.0
    if task == "gsm8k":
        c.task.name, c.task.path = "gsm8k", GSM8K
    return c


@pytest.mark.parametrize("method, task", [("torl", "arithmetic"), ("torl", "gsm8k"),
                                          ("simpletir", "arithmetic"), ("simpletir", "gsm8k")])
def test_expert_rows_are_what_a_rollout_of_the_experts_actions_sees(tokenizer, method, task):
    config = _config(method, task)
    suite = build_suite(config, split="train")
    rows = expert_rows(config, tokenizer)
    demonstrated = [(t, suite.demonstrate(t)) for t in suite.tasks]
    demonstrated = [(t, d) for t, d in demonstrated if d is not None]
    assert len(rows) == len(demonstrated) >= 5
    engine = RolloutEngine(None, tokenizer, suite.env, rollout_config(config))
    try:
        for row, (task_, demonstration) in zip(rows, demonstrated):
            branch, prompt_ids = open_branch(engine, task_)
            expected = [(prompt_ids, False)]
            for step in demonstration.steps:
                sampled = act_written(engine, branch, step.action, finish_reason="eos" if step.ends_turn else "stop")
                # the real sandbox prints what the demonstration shows
                assert sampled.observation_text == step.observation, (task_.question, step.action)
                eot = [end_of_turn_id(tokenizer)] if step.ends_turn else []
                expected.append((sampled.action_ids + eot, True))
                if sampled.observation_ids:
                    expected.append((sampled.observation_ids, False))
            assert branch.done and branch.termination == "answer", task_.question
            trajectory = Trajectory("t", task_.id, task_.question, "", prompt_ids, steps=branch.steps,
                                    final_answer=branch.final_answer)
            assert suite.outcome_rule(task_, trajectory) == "true", task_.question
            assert [(list(s.ids), s.loss) for s in row.prefix] == expected
            assert row.prefix[-1].ids[-1] == end_of_turn_id(tokenizer)
    finally:
        engine.close()


def test_a_gsm8k_step_python_would_not_print_for_certain_leaves_its_problem_out():
    from steprl_jax.data.arithmetic import python_printed
    from steprl_jax.data.gsm8k import GSM8KProblem

    assert python_printed("48/2") == "24.0" and python_printed("(3+4)*2") == "14"
    assert python_printed("2**10") == "1024" and python_printed("-7//2") == "-4" and python_printed("0.1+0.2") == str(0.1 + 0.2)
    for bad in ("x*2", "1/0", "10**1000", "1,000+2", "abs(-3)"):
        with pytest.raises(ValueError):
            python_printed(bad)
    problem = GSM8KProblem("q", "s", "5", (("2+3", "5"), ("x+1", "6")))
    with pytest.raises(ValueError):
        problem.code_demonstration()
    with pytest.raises(ValueError, match="at least one step"):
        GSM8KProblem("q", "s", "5", ()).code_turns_demonstration()


def test_the_flow_formats_expert_rows_are_the_planners_first_turns(tokenizer):
    from configs import flow_grpo_arithmetic
    from steprl_jax.agents import flow

    c = flow_grpo_arithmetic.get_config()
    c.task.num_tasks = 2
    # frozen modules behind an endpoint: building the suite contacts none
    c.rl.flow_grpo.frozen.kind, c.rl.flow_grpo.frozen.base_url, c.rl.flow_grpo.frozen.model = (
        "http", "http://127.0.0.1:9/v1", "frozen")
    rows = expert_rows(c, tokenizer)
    assert len(rows) == 2
    for row in rows:  # the planner's prompt, then its reply (trained) handing the steps to python
        prompt, reply = row.prefix
        assert not prompt.loss and reply.loss and "Previous Steps:**\nNone" in tokenizer.decode(prompt.ids)
        assert flow.parse_planner_step(tokenizer.decode(reply.ids[:-1]), flow.TOOLS).tool_name == flow.PYTHON_CODER
