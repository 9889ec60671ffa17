"""The rollout engine end to end with the real SmolLM2-135M-Instruct and real tools.

Greedy decoding, few steps, short actions: the point is exactness of what is recorded,
not the quality of a 135M model's answers.
"""
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.records import RecordStore
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.agents.tree_batch import unpacked_rows
from steprl_jax.data.arithmetic import arithmetic_problems
from steprl_jax.ops.advantages import tree_advantages
from steprl_jax.ops.logprobs import token_logprobs
from steprl_jax.ops.tree_arrays import node_values_to_tokens, stack_trees
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.protocol import Tool, object_schema
from steprl_jax.tools.registry import ToolRegistry
from steprl_jax.agents.schedules import tree as tree_schedule
from steprl_jax.agents.schedules.tree import TreeSettings

GREEDY = dict(temperature=0.0, max_new_tokens=24, max_context=1024, batch_size=4)


@pytest.fixture(scope="module")
def smol():
    from models_real import smollm2
    from steprl_jax.sampling import Sampler

    model, tokenizer = smollm2()  # shared with the other real-model files this process runs
    return model, tokenizer, Sampler(model, tokenizer, max_context=1024)


def _tasks(n, seed=0):
    return [Task(p.id, p.question, p.answer) for p in arithmetic_problems(n, seed=seed)]


def _env(tools=None):
    examples = [p.demonstration() for p in arithmetic_problems(4, seed=10_007)[1:3]]
    return TaggedEnv(ToolRegistry(tools or [calculator_tool()]), examples=examples)


def _rescore(model, ids):
    """The model's log-prob of each of ids[1:]. Right-padded to a multiple of 256 tokens, so that
    trajectories of different lengths share one compiled program (causal: padding after a
    position changes nothing at it)."""
    n = len(ids) - 1
    inputs, targets = np.zeros((2, 1, -(-n // 256) * 256), np.int32)
    inputs[0, :n], targets[0, :n] = ids[:-1], ids[1:]
    hidden = model.hidden_states(jnp.asarray(inputs))
    return np.asarray(token_logprobs(hidden, model.unembedding(), jnp.asarray(targets)))[0, :n]


def test_records_reproduce_the_models_logprobs(smol):
    model, tokenizer, sampler = smol
    engine = RolloutEngine(sampler, tokenizer, _env(), RolloutConfig(max_steps=3, **GREEDY))
    trajectories = list(engine.run([(f"e{i}", t) for i, t in enumerate(_tasks(2))]))
    assert any(s.kind == "math" and s.observation_ids for t in trajectories for s in t.steps)
    for trajectory in trajectories:
        ids = trajectory.all_ids()
        logp = _rescore(model, ids)
        position = len(trajectory.prompt_ids)
        for step in trajectory.steps:
            recorded = np.asarray(step.action_logprobs)
            # logp[j] scores ids[j + 1]: the action starts at `position`.
            np.testing.assert_allclose(logp[position - 1:position - 1 + len(recorded)], recorded, atol=1e-4)
            assert tokenizer.decode(step.action_ids, skip_special_tokens=True) == step.action_text
            position += len(step.action_ids) + len(step.observation_ids)
        assert trajectory.termination in ("answer", "step_cap", "context")
    # Cache continuation, not re-prefill: only the prompts were prefilled.
    assert engine.stats.prefill_tokens == sum(len(t.prompt_ids) for t in trajectories)


def _faulty(kind):
    def run(expression):
        if kind == "raise":
            raise RuntimeError("disk on fire")
        if kind == "hang":
            time.sleep(3)
        return "9" * 10_000_000  # 10 MB

    return Tool("calculator", "a calculator that misbehaves", object_schema({"expression": {"type": "string"}}),
                run, timeout_s=0.5)


@pytest.mark.parametrize("kind,expected", [("raise", "tool_failure"), ("hang", "timeout"), ("huge", "truncated")])
def test_a_faulty_tool_is_an_observation_and_the_episode_goes_on(smol, kind, expected):
    model, tokenizer, sampler = smol
    config = RolloutConfig(max_steps=2, max_result_chars=300, **GREEDY)
    engine = RolloutEngine(sampler, tokenizer, _env([_faulty(kind)]), config)
    (trajectory,) = engine.run([("e0", _tasks(1)[0])])
    first = trajectory.steps[0]
    assert first.kind == "math", first.action_text
    assert expected in first.observation_text
    assert len(first.observation_text) < 1000
    assert len(trajectory.steps) == 2  # the episode went on after the fault


@pytest.mark.parametrize("schedule", ["static", "resample"])
def test_tree_shares_its_prefix_and_converts_to_advantages(smol, schedule):
    model, tokenizer, sampler = smol
    # 12 new tokens: sampled actions are rarely well formed, their length does not matter here
    config = RolloutConfig(max_steps=3, **{**GREEDY, "temperature": 1.0, "batch_size": 8, "max_new_tokens": 12})
    engine = RolloutEngine(sampler, tokenizer, _env(), config, seed=3)
    tasks = _tasks(2)
    trees = tree_schedule.run(engine, [(f"tree{i}", t) for i, t in enumerate(tasks)],
                              TreeSettings(n=4, f=2, mode=schedule, fork_depths=(1, 2)), seed=0)
    # Each prompt is prefilled once; branches come from cache forks.
    assert engine.stats.prefill_tokens == sum(len(t.prompt_ids) for t in trees)
    assert engine.stats.forks >= 1
    for tree in trees:
        leaves = tree.leaves()
        assert 1 <= len(leaves) <= 4
        assert set(tree.leaf_terminations) == {str(leaf) for leaf in leaves}
        tree.leaf_outcomes = {str(leaf): float(i % 3 - 1) for i, leaf in enumerate(leaves)}
    rollout_trees, rows = zip(*[unpacked_rows(t) for t in trees])
    arrays = stack_trees(list(rollout_trees), max_nodes=16)
    rewards, advantages = jax.vmap(lambda p, o, f, v: tree_advantages(p, o, f, valid_n=v))(
        arrays.parent, arrays.leaf_outcome, arrays.fm_reward, arrays.valid)
    assert np.all(np.isfinite(np.asarray(advantages)))
    # Each tree's rows have their own index space; scatter one tree and check the shared step.
    tree0, rows0 = rollout_trees[0], rows[0]
    width = max(len(r) for r in rows0)
    per_token = node_values_to_tokens([tree0], np.asarray(advantages)[:1], shape=(len(rows0), width))
    first = tree0.nodes[0]
    for row, start, end in first.spans:
        np.testing.assert_allclose(per_token[row, start:end], float(advantages[0, 0]))
        assert rows0[row][start:end] == trees[0].nodes[0].step.action_ids


def test_interrupted_run_resumes_to_the_same_records(smol, tmp_path):
    from configs import demo
    from steprl_jax.evaluation import runner

    model, tokenizer, _ = smol

    def config(workdir, n):
        c = demo.get_config()
        c.workdir = str(workdir)
        c.task.num_tasks = n
        c.model.compute_dtype = "float32"
        c.progress = False
        c.rollout.update(temperature=0.0, max_steps=2, max_new_tokens=24, batch_size=1)
        return c

    runner.evaluate(config(tmp_path / "whole", 2), model_and_tokenizer=(model, tokenizer))
    runner.evaluate(config(tmp_path / "parts", 1), model_and_tokenizer=(model, tokenizer))  # stopped early
    metrics = runner.evaluate(config(tmp_path / "parts", 2), model_and_tokenizer=(model, tokenizer))

    def strip(record):
        data = record.to_json()
        for step in data["steps"]:
            step["generate_s"] = step["tool_s"] = 0.0
        return data

    whole = [strip(r) for r in RecordStore(tmp_path / "whole" / "trajectories.jsonl").load()]
    parts = [strip(r) for r in RecordStore(tmp_path / "parts" / "trajectories.jsonl").load()]
    assert whole == parts
    assert metrics["episodes"] == 2
    assert (tmp_path / "parts" / "summary.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, sampler): a tiny random llama with the SmolLM2 tokenizer, one sampler for
    the file's tests (its compiled programs are shared; every test passes its own keys)."""
    from hashed_env import tiny_random_policy

    return tiny_random_policy(seed=7)


def test_sampled_rollouts_with_a_tiny_random_model_rescore_exactly(tiny):
    """Temperature sampling on a tiny random model: invalid actions become error observations,
    episodes hit the step cap, and every recorded log-prob is the model's (at that temperature)."""
    model, tokenizer, sampler = tiny
    rollout = RolloutConfig(max_steps=3, max_new_tokens=12, max_context=2048, temperature=0.8, batch_size=3)
    engine = RolloutEngine(sampler, tokenizer, _env(), rollout, seed=1)
    trajectories = list(engine.run([(f"e{i}", t) for i, t in enumerate(_tasks(3))]))
    assert {t.termination for t in trajectories} <= {"step_cap", "answer", "context"}
    assert any(s.kind == "invalid" and "Error" in s.observation_text for t in trajectories for s in t.steps)
    for trajectory in trajectories:
        ids = trajectory.all_ids()
        hidden = model.hidden_states(jnp.asarray([ids[:-1]]))
        logp = np.asarray(token_logprobs(hidden, model.unembedding(), jnp.asarray([ids[1:]]), temperature=0.8))[0]
        position = len(trajectory.prompt_ids)
        for step in trajectory.steps:
            np.testing.assert_allclose(logp[position - 1:position - 1 + len(step.action_ids)],
                                       step.action_logprobs, atol=1e-4)
            position += len(step.action_ids) + len(step.observation_ids)


@pytest.mark.parametrize("schedule", ["static", "resample"])
def test_two_trees_of_the_same_query_in_one_batch_stay_apart(schedule, tiny):
    """An online loop samples queries with replacement: the same task twice in one batch makes two
    trees, each with its own n leaves and its own nodes."""
    _, tokenizer, sampler = tiny
    rollout = RolloutConfig(max_steps=3, max_new_tokens=6, max_context=2048, temperature=1.0, batch_size=8)
    engine = RolloutEngine(sampler, tokenizer, _env(), rollout, seed=1)
    task = _tasks(1)[0]
    trees = tree_schedule.run(engine, [("a", task), ("b", task)], TreeSettings(n=4, f=2, mode=schedule, fork_depths=(1, 2)),
                              seed=0)
    assert [t.id for t in trees] == ["a", "b"] and {t.query_id for t in trees} == {task.id}
    for tree in trees:
        leaves = tree.leaves()
        assert len(leaves) == 4, (tree.id, len(leaves))
        assert set(tree.leaf_terminations) == {str(leaf) for leaf in leaves}
        assert all(tree.nodes[leaf].depth == len(tree.path(leaf)) == 3 for leaf in leaves)  # step cap
        for i, node in enumerate(tree.nodes):
            assert node.parent < i and node.depth == (1 if node.parent < 0 else tree.nodes[node.parent].depth + 1)
    if schedule == "static":  # forks at depths 1 and 2: 2 + 4 + 4 steps
        assert [len(t.nodes) for t in trees] == [10, 10]
    # No step is recorded in both trees.
    assert not {id(n.step) for n in trees[0].nodes} & {id(n.step) for n in trees[1].nodes}


def test_static_trees_fill_to_n_leaves(tiny):
    """Static forks fill the tree to n leaves: partly at a configured depth where a whole f-way fork
    would overshoot, and past the last configured depth when branches finished early."""
    _, tokenizer, sampler = tiny
    rollout = RolloutConfig(max_steps=4, max_new_tokens=6, max_context=2048, temperature=1.0, batch_size=8)
    engine = RolloutEngine(sampler, tokenizer, _env(), rollout, seed=1)
    (tree,) = tree_schedule.run(engine, [("a", _tasks(1)[0])], TreeSettings(n=6, f=2, fork_depths=(1, 2, 3)), seed=0)
    # 2, 4, then 2 of the 4 fork (6 = n, not 8), then one sample each: 2 + 4 + 6 + 6 steps.
    assert len(tree.leaves()) == 6 and len(tree.nodes) == 18
    copies = lambda open_trees, done_trees, depth: list(tree_schedule._copies(  # noqa: E731
        open_trees, done_trees, 2, 8, 2, depth, {1, 2, 3}, "static").values())
    branch = lambda t: types.SimpleNamespace(tree=t)  # noqa: E731
    # Depth 3, tree 0 has 4 open branches and 1 finished: 3 of them fork (8 leaves); tree 1 has 4 open.
    assert copies([branch(0) for _ in range(4)] + [branch(1) for _ in range(4)],
                  [branch(0)], 3) == [2, 2, 2, 1, 2, 2, 2, 2]
    # Depth 5, past the configured depths: tree 0 (5 open, 2 finished) fills to 8; tree 1 (8 open) does not.
    assert copies([branch(0) for _ in range(5)] + [branch(1) for _ in range(8)], [branch(0)] * 2, 5) == \
        [2] + [1] * 12


def _jittery_calculator(seed):
    """The real calculator, each call taking a random 0-60 ms, so that the engines interleave rows
    differently from run to run."""
    base, rng = calculator_tool(), np.random.default_rng(seed)

    def run(expression):
        time.sleep(float(rng.uniform(0, 0.06)))
        return base.fn(expression=expression)

    return Tool(base.name, base.description, base.parameters, run, timeout_s=5.0)


def _same_records(a, b, atol):
    by_id = {t.id: t for t in b}
    assert sorted(by_id) == sorted(t.id for t in a)
    for x in a:
        y = by_id[x.id]
        assert (x.termination, x.final_answer, x.prompt_ids) == (y.termination, y.final_answer, y.prompt_ids), x.id
        assert len(x.steps) == len(y.steps), x.id
        for s, t in zip(x.steps, y.steps):
            assert s.action_ids == t.action_ids and s.observation_ids == t.observation_ids, x.id
            assert s.action_text == t.action_text and s.kind == t.kind
            np.testing.assert_allclose(s.action_logprobs, t.action_logprobs, atol=atol)


def test_continuous_batching_records_equal_the_batch_engines(smol):
    """Greedy on the real model, 5 episodes on 2 rows: the continuous engine (rows handed to waiting
    episodes, decoding in short calls) records exactly what the batch-at-a-time engine records."""
    _, tokenizer, sampler = smol
    tasks = [(f"e{i}", t) for i, t in enumerate(_tasks(5, seed=3))]
    runs = {}
    for continuous in (False, True):
        config = RolloutConfig(max_steps=3, **{**GREEDY, "batch_size": 2}, continuous=continuous, decode_chunk=8)
        engine = RolloutEngine(sampler, tokenizer, _env([_jittery_calculator(int(continuous))]), config)
        runs[continuous] = list(engine.run(tasks))
        engine.close()
    # Float32 sums over differently laid-out caches differ in the last bits: the rescoring tolerance.
    _same_records(runs[True], runs[False], atol=1e-4)
    assert engine.stats.inserts == 3  # 5 episodes on 2 rows: 3 started in freed rows
    # The worked examples every prompt starts with are computed once, not per inserted episode.
    assert engine.stats.prefill_tokens < sum(len(t.prompt_ids) for t in runs[True]) - 3 * 100
    assert any(s.tool_calls for t in runs[True] for s in t.steps)
    assert len({len(s.action_ids) for t in runs[True] for s in t.steps}) > 1  # actions of different lengths


def test_continuous_sampling_depends_on_the_episode_not_the_schedule(tiny):
    """Temperature sampling on a tiny random model: per-episode keys make the continuous engine
    (actions split over calls of 5 tokens, rows reused) sample what the batch engine samples.

    Temperature 0.1: the tiny model's logits (std ~0.16) then give a few nats of entropy per token
    (distinct samples) without a near-uniform 49,152-token distribution, where the inverse-CDF
    draw lands within float32 rounding of a boundary between adjacent tokens often enough that
    the two engines' differently shaped matmuls (last-bit differences) flipped a draw on an AVX2
    host at temperature 1."""
    _, tokenizer, sampler = tiny
    tasks = [(f"e{i}", t) for i, t in enumerate(_tasks(5))]
    runs = {}
    for continuous in (False, True):
        config = RolloutConfig(max_steps=2, max_new_tokens=12, max_context=2048, temperature=0.1, batch_size=2,
                               continuous=continuous, decode_chunk=5)
        engine = RolloutEngine(sampler, tokenizer, _env(), config, seed=4)
        runs[continuous] = list(engine.run(tasks))
        engine.close()
    _same_records(runs[True], runs[False], atol=1e-5)
    assert engine.stats.inserts == 3 and engine.stats.generate_calls >= 3 * 5  # 12 tokens in calls of 5
    assert engine.stats.shrinks >= 1  # the last episode decoded alone, on a narrowed cache
    assert len({tuple(t.steps[0].action_ids) for t in runs[True]}) == 5  # distinct samples
