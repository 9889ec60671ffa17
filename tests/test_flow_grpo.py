"""Flow-GRPO (AgentFlow): the advantage math (ops/flow_grpo.py), hand-computed; the planner-step
parser and the memory (agents/flow.py); the flow rollout (agents/schedules/flow.py) with a tiny
random planner, frozen modules behind a real OpenAI-compatible endpoint on 127.0.0.1
(tests/chat_stub.py) or the tiny base model itself, and the real Python sandbox; the method's
batch (algorithms/flow_grpo.py) and one online iteration end to end."""
import math

import pytest

from steprl_jax.agents import flow
from steprl_jax.ops.flow_grpo import flow_advantages, rollout_total_weights


# ---- advantages ---------------------------------------------------------------------------
def test_per_rollout_advantage_is_the_group_zscore_of_the_outcomes_and_each_rollout_weighs_one():
    # rewards 1, 0, 0, 1: mean 1/2, sample std sqrt(4 * 1/4 / 3) = sqrt(1/3)
    tokens = [[4], [2, 6], [5, 5, 10], [8]]
    out = flow_advantages([1.0, 0.0, 0.0, 1.0], tokens, normalize="rollout")
    a = 0.5 / math.sqrt(1 / 3)
    assert [w.advantage for w in out] == pytest.approx([a, -a, -a, a], abs=1e-5)
    # a token mean inside each rollout: 1 / (its response tokens)
    assert [w.token_weight for w in out] == pytest.approx([1 / 4, 1 / 8, 1 / 20, 1 / 8])
    assert rollout_total_weights(out, tokens) == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_per_row_advantage_counts_every_planner_call_and_weighs_every_token():
    # rows: rollout 0 has 1 row (r=1), rollout 1 has 3 rows (r=0): the rows' rewards are 1, 0, 0, 0
    tokens = [[10], [10, 10, 10]]
    out = flow_advantages([1.0, 0.0], tokens, normalize="row")
    mean, std = 0.25, math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)
    assert out[0].advantage == pytest.approx((1 - mean) / std, abs=1e-5)
    assert out[1].advantage == pytest.approx((0 - mean) / std, abs=1e-5)
    assert [w.token_weight for w in out] == [1.0, 1.0]
    assert rollout_total_weights(out, tokens) == [10.0, 30.0]


def test_a_long_failing_rollout_among_short_successes_differs_between_the_two_normalisations():
    rewards, tokens = [1.0, 0.0, 1.0, 1.0], [[10], [10, 10, 10], [10], [10]]
    per_rollout = flow_advantages(rewards, tokens, normalize="rollout")
    per_row = flow_advantages(rewards, tokens, normalize="row")
    # per rollout: 1, 0, 1, 1 -> mean 3/4, std sqrt(3/4 / 3) = 1/2 -> +1/2 and -3/2
    assert [w.advantage for w in per_rollout] == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)
    # per row: 1, 0, 0, 0, 1, 1 -> mean 1/2, std sqrt(6/4 / 5) -> +-0.9129: the failure is pushed
    # down less, the successes up more
    s = math.sqrt(1.5 / 5)
    assert [w.advantage for w in per_row] == pytest.approx([0.5 / s, -0.5 / s, 0.5 / s, 0.5 / s], abs=1e-5)
    # loss shares: equal per rollout; per row the failing rollout carries half the batch's tokens
    assert rollout_total_weights(per_rollout, tokens) == pytest.approx([1, 1, 1, 1])
    assert rollout_total_weights(per_row, tokens) == [10, 30, 10, 10]


def test_failed_verdicts_and_empty_rollouts_count_nowhere_and_a_tie_has_no_signal():
    out = flow_advantages([1.0, None, 0.0, 1.0], [[3], [3], [3], []], normalize="rollout")
    assert out[1] is None and out[3] is None
    assert [out[0].advantage, out[2].advantage] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert all(w.advantage == 0 for w in flow_advantages([1.0, 1.0, 1.0], [[2], [2, 2], [1]], normalize="row"))
    assert flow_advantages([1.0], [[2]], normalize="rollout")[0].advantage == 0.0  # one member, ddof 1
    with pytest.raises(ValueError, match="normalize"):
        flow_advantages([1.0], [[1]], normalize="token")


# ---- the planner's step, the memory and the frozen modules' replies ------------------------
def test_the_planner_step_parser_reads_the_last_sections_and_matches_tools_leniently():
    reply = ("Justification: a product is needed.\n**Context:** 6 apples, 7 boxes\n**Sub-Goal:** Compute 6*7.\n"
             "**Tool Name:** python coder tool\n")
    step = flow.parse_planner_step(reply, flow.TOOLS)
    assert step == flow.PlannerStep("a product is needed.", "6 apples, 7 boxes", "Compute 6*7.", flow.PYTHON_CODER)
    # the last match wins; the tool name is its section's first line; underscores and case do not matter
    twice = "Context: a\nSub-Goal: b\nTool Name: Nope\nContext: c\nSub-goal: d\nTool_Name: base_generator_TOOL\nwhy"
    last = flow.parse_planner_step(twice, flow.TOOLS)
    assert (last.context, last.sub_goal, last.tool_name, last.problem) == ("c", "d", flow.GENERATOR, None)
    assert flow.parse_planner_step("Context: a Sub-Goal: b Tool Name: Google_Search_Tool", flow.TOOLS).problem \
        == "unknown_tool"
    for bad in ("", "no sections at all", None, "Sub-Goal: b\nTool Name: Python_Coder_Tool"):
        assert flow.parse_planner_step(bad, flow.TOOLS).problem == "no_step"


def test_memory_renders_each_step_compactly_with_long_results_clipped():
    assert flow.render_memory([]) == "None"
    entries = [flow.MemoryEntry(flow.PYTHON_CODER, "Compute 6*7.", "print(6*7)", "42"),
               flow.MemoryEntry(flow.GENERATOR, "Say it.", "Say it.", "x" * 1000)]
    text = flow.render_memory(entries, result_chars=50)
    assert text.startswith("Action Step 1:\n  Tool: Python_Coder_Tool\n  Sub-Goal: Compute 6*7.\n"
                           "  Command: print(6*7)\n  Result: 42\nAction Step 2:\n")
    assert "  Result: " + "x" * 22 + " ... " + "x" * 22 in text and len(text) < 300
    assert flow.render_entry(entries[0]) in text


def test_the_frozen_modules_replies_are_read_as_the_reference_reads_them():
    assert flow.parse_conclusion("All there.\nConclusion: **STOP**") == flow.STOP
    assert flow.parse_conclusion("Conclusion: STOP? no. Conclusion: CONTINUE") == flow.CONTINUE
    assert flow.parse_conclusion("we must stop now") == flow.STOP
    assert flow.parse_conclusion("unclear") == flow.CONTINUE
    assert flow.parse_command("Generated Command:\n```python\nx = 6 * 7\nprint(x)\n```") == "x = 6 * 7\nprint(x)"
    assert flow.parse_command("print(42)") is None
    assert flow.final_answer("so <answer>1</answer> no <answer> 42 </answer>") == "42"
    assert flow.final_answer("\\boxed{42}") == "42"
    assert flow.final_answer("**Answer:** 42") == "**Answer:** 42" and flow.final_answer("  ") is None


# ---- the rollout: real sandbox, a real endpoint for the frozen modules, a tiny random planner ----
def _frozen_reply(verdict="CONTINUE", answers=("42",)):
    """What the frozen modules answer on the endpoint: code for the executor, `verdict` for the
    verifier, `answers` in turn for the solution generator, text for the generator tool."""
    count = {"solutions": 0}

    def reply(body, i):
        text = body["messages"][-1]["content"]
        if text.startswith("Task: Generate precise Python code"):
            if "no code" in text:
                return "I would rather not."
            if "divide" in text:
                return "Generated Command:\n```python\nprint(1 / 0)\n```"
            return "Generated Command:\n```python\nprint(6 * 7)\n```"
        if text.startswith("Task: Evaluate if the current memory"):
            return f"Looks fine.\nConclusion: {verdict}"
        if text.startswith("Task: Generate a concise final answer"):
            count["solutions"] += 1
            return f"**Answer:** <answer>{answers[(count['solutions'] - 1) % len(answers)]}</answer>"
        return "forty-two"
    return reply


@pytest.fixture(scope="module")
def tokenizer():
    from swirl_helpers import smol_tokenizer

    return smol_tokenizer()


def _flow_env(base_url):
    from steprl_jax.tools.python_sandbox import SandboxSettings, python_tool
    from steprl_jax.tools.registry import ToolRegistry

    registry = ToolRegistry([python_tool(SandboxSettings(wall_timeout_s=5.0, cpu_s=2))])
    return flow.FlowEnv(registry, flow.http_frozen_model(base_url, "frozen", max_tokens=64), result_chars=200)


def test_a_turn_runs_the_executor_command_in_the_sandbox_and_every_failure_is_an_error_in_memory():
    import jax

    from chat_stub import ChatStub
    from steprl_jax.agents.records import Step
    from steprl_jax.agents.schedules import flow as flow_schedule

    stub = ChatStub(_frozen_reply())
    env = _flow_env(stub.base_url)
    try:
        replies = ["Context: 6 and 7\nSub-Goal: multiply them\nTool Name: Python_Coder_Tool",
                   "Context: -\nSub-Goal: say 6*7 in words\nTool Name: Base_Generator_Tool",
                   "Context: -\nSub-Goal: no code please\nTool Name: Python_Coder_Tool",
                   "Context: -\nSub-Goal: divide by zero\nTool Name: Python_Coder_Tool",
                   "Context: -\nSub-Goal: look it up\nTool Name: Wikipedia_Search_Tool",
                   "I think the answer is 42."]
        live = []
        for i, text in enumerate(replies):
            r = flow_schedule._Rollout(0, i, "What is 6 times 7?")
            r.steps.append(Step(text, [1], [0.0], prompt_ids=[2]))
            live.append(r)
        flow_schedule._act(env, live, flow_schedule._frozen_seeds(jax.random.PRNGKey(0)), 0)
        results = [r.memory[0].result for r in live]
        assert results[0] == "42" and live[0].memory[0].command == "print(6 * 7)"
        assert live[0].steps[0].kind == "tool_call" and live[0].steps[0].tool_results[0]["name"] == flow.PYTHON_CODER
        assert results[1] == "forty-two" and live[1].memory[0].command == "say 6*7 in words"
        assert results[2].startswith("Error (no_command)")
        assert "ZeroDivisionError" in results[3]
        assert results[4] == "Error (unknown_tool): No command was generated because the tool was not found."
        assert results[5].startswith("Error (unparseable)") and live[5].steps[0].kind == "invalid"
        assert live[5].steps[0].format_problems == ["no_step"] and live[5].steps[0].tool_calls == []
        assert live[0].steps[0].observation_text == flow.render_entry(live[0].memory[0], 200)
    finally:
        env.close()
        stub.close()


def _queries():
    from steprl_jax.agents.environments import Task
    from steprl_jax.agents.schedules import Query

    return [Query(f"q{j}", Task(f"t{j}", question, answer), j)
            for j, (question, answer) in enumerate([("What is 6 times 7?", "42"), ("What is 40 plus 2?", "42")])]


def _engine(tokenizer, env, seed=0):
    from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
    from steprl_jax.sampling import Sampler
    from swirl_helpers import tiny_model

    sampler = Sampler(tiny_model(tokenizer, seed=seed), tokenizer, max_context=2048)
    return RolloutEngine(sampler, tokenizer, env, RolloutConfig(max_new_tokens=8, max_context=2048, batch_size=8,
                                                                temperature=1.0))


def test_a_flow_rollout_records_each_planner_call_with_the_exact_prompt_it_saw_and_one_outcome_per_rollout(tokenizer):
    import jax

    from chat_stub import ChatStub
    from steprl_jax.agents.records import TreeRecord, validate_record
    from steprl_jax.agents.schedules import flow as flow_schedule
    from steprl_jax.algorithms import flow_grpo
    from steprl_jax.judges import rules
    from steprl_jax.judges.judging import Judging
    from steprl_jax.models import chat

    stub = ChatStub(_frozen_reply(answers=("42", "41", "42")))
    env = _flow_env(stub.base_url)
    engine = _engine(tokenizer, env)
    try:
        settings = flow_schedule.FlowSettings(n=3, max_turns=2)
        records = flow_schedule.run(engine, _queries(), settings, key=jax.random.PRNGKey(0))
    finally:
        engine.close()
        env.close()
        stub.close()
    assert [r.query_id for r in records] == ["t0", "t1"]
    for record in records:
        assert len(record.leaves()) == 3
        for leaf in record.leaves():
            path = record.path(leaf)
            assert len(path) == 2  # the verifier said CONTINUE: every rollout plans max_turns times
            steps = [record.nodes[i].step for i in path]
            first = chat.apply_chat(tokenizer, flow.planner_messages(record.question, env.tool_names, "None"),
                                    tokenize=False)
            assert steps[0].prompt_ids == tokenizer(first, add_special_tokens=False)["input_ids"]
            # the second call's prompt is the first's memory entry rendered into the planner prompt
            entry = steps[0].observation_text.split("\nVerifier:")[0]
            assert entry in tokenizer.decode(steps[1].prompt_ids) and "Verifier: CONTINUE" in steps[0].observation_text
            for step in steps:
                assert 0 < len(step.action_ids) == len(step.action_logprobs) <= 8
            assert record.leaf_answers[str(leaf)] in ("41", "42") and "\nSolution: " in steps[-1].observation_text
        data = record.to_json()
        validate_record(data, "here")
        assert TreeRecord.from_json(data) == record
    # judged by the flow suite's outcome rule; every planner row of a rollout carries its advantage
    judging = Judging(outcome_rule=lambda task, traj: rules.math_verify_outcome(traj.final_answer, task.reference))
    tasks = {q.task.id: q.task for q in _queries()}
    judging.judge_trees([(tasks[r.query_id], r) for r in records])
    s = flow_grpo.FlowGrpoSettings(settings, 1.0, "rollout", 1, 0.2, 0.3, 0.001)
    rows, metrics = flow_grpo.build(records, s)
    assert len(rows) == 12 and metrics["rows_per_rollout"] == 2.0
    at = 0
    for record in records:
        leaves = record.leaves()
        outcomes = [record.leaf_outcomes[str(leaf)] for leaf in leaves]
        assert sorted(set(outcomes)) in ([-1.0, 1.0], [1.0], [-1.0])
        expected = flow_advantages(outcomes, [[len(record.nodes[i].step.action_ids) for i in record.path(leaf)]
                                              for leaf in leaves])
        for leaf, w in zip(leaves, expected):
            for node in record.path(leaf):
                ids, loss, lp, adv = rows[at].flat()[:4]
                step = record.nodes[node].step
                assert ids == step.prompt_ids + step.action_ids  # the exact prompt, then the sampled reply
                assert adv[-len(step.action_ids):] == pytest.approx([w.advantage] * len(step.action_ids))
                assert loss[-len(step.action_ids):] == pytest.approx([w.token_weight] * len(step.action_ids))
                assert lp[-len(step.action_ids):] == pytest.approx(step.action_logprobs)
                assert not any(loss[:len(step.prompt_ids)])
                at += 1


# ---- the method: its batch, its settings, the online loop ------------------------------------
def _record(rollouts, outcomes):
    """A judged flow record: rollouts given as lists of (prompt ids, reply ids) planner calls."""
    from steprl_jax.agents.records import Step, TreeNode, TreeRecord

    record = TreeRecord("it0/r0/q0", "t0", "q?", "", [])
    for calls, outcome in zip(rollouts, outcomes):
        parent = -1
        for depth, (prompt, reply) in enumerate(calls, start=1):
            step = Step("reply", list(reply), [-0.5] * len(reply), prompt_ids=list(prompt))
            record.nodes.append(TreeNode(parent=parent, step=step, depth=depth))
            parent = len(record.nodes) - 1
        record.leaf_outcomes[str(parent)] = outcome
    return record


def test_the_built_batch_weighs_each_rollout_the_same_per_rollout_and_each_token_the_same_per_row():
    from steprl_jax.agents.schedules.flow import FlowSettings
    from steprl_jax.algorithms import flow_grpo

    short, long_ = [([1, 2, 3], [4] * 10)], [([1, 2, 3], [5] * 10), ([1, 2, 6], [7] * 10), ([1, 2, 8], [9] * 10)]
    record = _record([short, long_, short, short], [1.0, -1.0, 1.0, 1.0])
    totals = {}
    for normalize in ("rollout", "row"):
        s = flow_grpo.FlowGrpoSettings(FlowSettings(n=4), 1.0, normalize, 1, 0.2, 0.3, 0.001)
        rows, _ = flow_grpo.build([record], s)
        assert len(rows) == 6
        weights = [sum(row.flat()[1]) for row in rows]  # the loss weight each row carries
        totals[normalize] = [weights[0], sum(weights[1:4]), weights[4], weights[5]]
        advantages = [row.flat()[3][-1] for row in rows]
        assert advantages[1] == advantages[2] == advantages[3] < 0 < advantages[0] == advantages[4]
    assert totals["rollout"] == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert totals["row"] == pytest.approx([10.0, 30.0, 10.0, 10.0])


def _flow_config(tmp_path, base_url=""):
    from configs import flow_grpo_arithmetic

    c = flow_grpo_arithmetic.get_config()
    c.workdir = str(tmp_path)
    c.progress = False
    c.task.num_tasks = 4
    c.rollout.max_new_tokens = 8
    c.rollout.tree.n = 3
    c.rl.iterations = 1
    c.rl.queries_per_iteration = 2
    c.rl.flow_grpo.max_turns = 2
    c.rl.flow_grpo.frozen.max_tokens = 16
    c.rl.eval.num_tasks = 0
    c.optimizer.learning_rate = 1e-3  # large enough that a step shows in the parameters
    if base_url:
        c.rl.flow_grpo.frozen.kind, c.rl.flow_grpo.frozen.base_url = "http", base_url
        c.rl.flow_grpo.frozen.model = "frozen"
    return c


def test_flow_grpo_settings_refuse_what_it_cannot_run(tmp_path):
    from configs import torl_arithmetic
    from steprl_jax import config_schema
    from steprl_jax.algorithms import online
    from steprl_jax.errors import ConfigError

    c = _flow_config(tmp_path)
    config_schema.check(c)
    settings = online.read_settings(c)
    assert settings.learner.loss.kl_coef == 0.001 and (settings.learner.loss.eps_low,
                                                       settings.learner.loss.eps_high) == (0.2, 0.3)
    assert settings.method.rollout.max_turns == 2 and settings.method.normalize == "rollout"
    c.rl.flow_grpo.normalize = "token"
    with pytest.raises(ConfigError, match="config.rl.flow_grpo.normalize"):
        online.read_settings(c)
    c.rl.flow_grpo.normalize = "row"
    t = torl_arithmetic.get_config()
    t.env.format = "flow"
    with pytest.raises(ConfigError, match="config.env.format: torl trains on the code format"):
        online.read_settings(t)


def test_one_online_iteration_of_flow_grpo_with_frozen_modules_behind_an_endpoint(tmp_path, tokenizer):
    import json

    from chat_stub import ChatStub
    from steprl_jax.algorithms import online
    from steprl_jax.training.metrics_log import read_metrics
    from swirl_helpers import tiny_model

    from steprl_jax.agents.tasks import build_suite

    references = {}  # question -> reference, filled once the config has the endpoint's address
    count = {"solutions": 0}
    frozen = _frozen_reply(verdict="STOP")

    def reply(body, i):  # every other solution right: the iteration has a learning signal
        text = body["messages"][-1]["content"]
        if not text.startswith("Task: Generate a concise final answer"):
            return frozen(body, i)
        count["solutions"] += 1
        right = next(ref for question, ref in references.items() if question in text)
        return f"<answer>{right if count['solutions'] % 2 else -1}</answer>"

    stub = ChatStub(reply)
    try:
        c = _flow_config(tmp_path, base_url=stub.base_url)
        # held-out evaluation before and after the iteration: the same system, one greedy rollout a query
        c.rl.eval.num_tasks = c.task.eval_num_tasks = 2
        c.rl.eval_every = 1
        for split in ("train", "test"):
            suite = build_suite(c, split=split)
            suite.env.close()
            references.update({t.question: t.reference for t in suite.tasks})
        summary = online.run(c, (tiny_model(tokenizer), tokenizer))
    finally:
        stub.close()
    assert summary["algorithm"] == "flow_grpo"
    row = read_metrics(str(tmp_path))["rl"][0]
    assert row["leaves"] == 6 and row["planner_rows"] == 6 and row["rows_per_rollout"] == 1.0  # STOP after turn 1
    assert row["trained_tokens"] > 0 and row["first_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert row["reward_mean"] == 0.0 and row["accuracy"] == 0.5  # 3 of the 6 solutions right: +1 / -1
    with open(tmp_path / "rollouts" / "iter_00000.jsonl") as f:
        trees = [json.loads(line) for line in f]
    assert len(trees) == 2 and all(n["step"]["prompt_ids"] for t in trees for n in t["nodes"])
    for it in (0, 1):
        with open(tmp_path / "eval" / f"iter_{it:05d}.metrics.json") as f:
            accuracy = json.load(f)["ci"]["accuracy"]
        assert accuracy["n"] == 2 and accuracy["value"] in (0.0, 0.5, 1.0)
        with open(tmp_path / "eval" / f"iter_{it:05d}.trajectories.jsonl") as f:
            evaluated = [json.loads(line) for line in f]
        assert len(evaluated) == 2 and all(len(t["leaf_answers"]) == 1 for t in evaluated)  # flow records


def test_the_planner_warm_start_row_is_the_first_planner_prompt_token_for_token_and_hands_the_steps_to_python(
        tmp_path, tokenizer):
    import jax

    from chat_stub import ChatStub
    from steprl_jax.agents.schedules import Query, flow as flow_schedule
    from steprl_jax.agents.tasks import build_suite
    from steprl_jax.algorithms import sft
    from steprl_jax.models.chat import end_of_turn_id

    stub = ChatStub(_frozen_reply())
    c = _flow_config(tmp_path, stub.base_url)
    suite = build_suite(c, split="train")
    try:
        task = suite.tasks[0]
        demonstration = suite.demonstrate(task)
        row = sft.demonstration_row(suite.env, tokenizer, task, demonstration)
        prompt, reply = row.prefix
        assert not prompt.loss and reply.loss and reply.ids[-1] == end_of_turn_id(tokenizer)
        # the schedule's first planner call sees exactly the row's prompt
        engine = _engine(tokenizer, suite.env)
        record = flow_schedule.run(engine, [Query("q", task, 0)], flow_schedule.FlowSettings(n=1, max_turns=1),
                                   jax.random.PRNGKey(0))[0]
        assert record.nodes[0].step.prompt_ids == list(prompt.ids)
        step = flow.parse_planner_step(tokenizer.decode(reply.ids[:-1]), suite.env.tool_names)
        assert step.problem is None and step.tool_name == flow.PYTHON_CODER
        problem_steps = [s.strip() for s in step.sub_goal.removeprefix("Calculate ").split(",")]
        assert problem_steps and all(any(ch.isdigit() for ch in s) for s in problem_steps)
    finally:
        suite.env.close()
        stub.close()


def test_the_frozen_modules_are_the_base_model_not_the_warm_started_planner(tmp_path, tokenizer):
    import jax
    import numpy as np

    from steprl_jax.algorithms import online
    from swirl_helpers import tiny_model

    c = _flow_config(tmp_path)  # frozen kind "base"
    base, planner = tiny_model(tokenizer, seed=0), tiny_model(tokenizer, seed=1)
    loop = online.build_loop(c, planner, tokenizer, base_model=base)
    try:
        leaves = lambda sampler: [np.array(x) for x in jax.tree.leaves(sampler._layer_params)]
        frozen, policy = leaves(loop.engine.env.frozen.backend.engine.sampler), leaves(loop.sampler)
        reference = online.build_loop(c, base, tokenizer)  # without a warm start: both the base model
        try:
            assert all(np.array_equal(a, b) for a, b in zip(frozen, leaves(reference.sampler)))
        finally:
            reference.close()
        assert not all(np.array_equal(a, b) for a, b in zip(frozen, policy))
    finally:
        loop.close()


def test_the_base_frozen_model_is_the_initial_policy_and_a_train_step_leaves_it_unchanged(tmp_path, tokenizer):
    import jax
    import numpy as np

    from steprl_jax.algorithms import online
    from swirl_helpers import tiny_model

    c = _flow_config(tmp_path)  # frozen kind "base"
    loop = online.build_loop(c, tiny_model(tokenizer), tokenizer)
    try:
        frozen_sampler = loop.engine.env.frozen.backend.engine.sampler
        snapshot = lambda sampler: [np.array(x) for x in jax.tree.leaves(sampler._layer_params)]
        frozen_before, policy_before = snapshot(frozen_sampler), snapshot(loop.sampler)
        assert all(np.array_equal(a, b) for a, b in zip(frozen_before, policy_before))  # the same initial weights
        result = loop.collect(0, 0)
        trees = result.kept
        assert len(trees) == 2 and all(len(t.leaves()) == 3 for t in trees)
        for tree in trees:  # outcomes set by hand: the random base model never answers right
            for k, leaf in enumerate(tree.leaves()):
                tree.leaf_outcomes[str(leaf)] = 1.0 if k == 0 else -1.0
        metrics = loop.train(trees)
        assert metrics["planner_rows"] >= 6 and metrics["advantage_abs"] > 0
        frozen_after, policy_after = snapshot(frozen_sampler), snapshot(loop.sampler)
        assert all(np.array_equal(a, b) for a, b in zip(frozen_before, frozen_after))
        assert not all(np.array_equal(a, b) for a, b in zip(policy_before, policy_after))  # the planner moved
    finally:
        loop.close()


def test_sampled_frozen_replies_depend_on_their_seeds_only(tokenizer):
    """At temperature 1 the base frozen model's reply to a conversation is decided by its seed: the
    same in any order and batch (the flow schedule seeds every frozen call from its rollout, turn
    and call); an endpoint is sent the seed."""
    from chat_stub import ChatStub
    from steprl_jax.agents.schedules.flow import _frozen_seeds
    from swirl_helpers import tiny_model

    import jax

    model = flow.base_frozen_model(tiny_model(tokenizer), tokenizer, max_context=256, temperature=1.0, max_tokens=8)
    try:
        asks = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
        first = [r.text for r in model.complete(asks, [11, 12, 13])]
        reordered = [r.text for r in model.complete(asks[::-1], [13, 12, 11])][::-1]
        assert first == reordered
        assert [r.text for r in model.complete(asks[:1], [11])] == first[:1]  # alone
        assert len(set(r.text for r in model.complete([asks[0]] * 4, [1, 2, 3, 4]))) > 1  # seeds differ, replies differ
        with pytest.raises(ValueError, match="2 seeds for 3 conversations"):
            model.complete(asks, [1, 2])
    finally:
        model.close()
    seed_of = _frozen_seeds(jax.random.PRNGKey(3))
    assert seed_of(5, 1, 0) == _frozen_seeds(jax.random.PRNGKey(3))(5, 1, 0)
    assert len({seed_of(5, 1, c) for c in range(3)} | {seed_of(6, 1, 0)}) == 4
    assert seed_of(5, 1, 0) != _frozen_seeds(jax.random.PRNGKey(4))(5, 1, 0)
    bodies = []
    stub = ChatStub(lambda body, i: bodies.append(body) or "ok")
    try:
        http = flow.http_frozen_model(stub.base_url, "frozen", temperature=0.7)
        assert [r.text for r in http.complete(asks[:2], [7, 8])] == ["ok", "ok"]
        http.close()
    finally:
        stub.close()
    assert sorted(b["seed"] for b in bodies) == [7, 8]
