"""SWiRL (algorithms/swirl.py): units, filters, group advantages, stage-2 rows and updates, SFT,
the whole pipeline on a tiny random model, and what bad input gives.

Tiny random models with the SmolLM2 tokenizer (chat template, stop strings); the stage-2 reward
model is a stub endpoint on 127.0.0.1 (swirl_helpers.RewardServer) whose graded scores vary
with the action, so a random model's advantages are not all zero.
"""
import collections
import dataclasses
import functools
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from steprl_jax.agents.records import RecordStore, Step, Trajectory
from steprl_jax.algorithms import sft as sft_lib
from steprl_jax.algorithms import swirl
from steprl_jax.training.learner import copy_model
from steprl_jax.ops.advantages import group_advantages
from steprl_jax.algorithms.workdir import IncompatibleRunError
from steprl_jax.data.units import UnitsError, read_units, write_units
from steprl_jax.judges.rewards import Reward
from steprl_jax.models import load_pretrained
from steprl_jax.sampling import Sampler, SamplingParams
from steprl_jax.sampling.params import Generation
from steprl_jax.training import OptimizerConfig, TrainStepConfig, create_train_state, make_optimizer, make_train_step
from steprl_jax.training.forward import sequence_logprobs
from steprl_jax.training.metrics_log import read_metrics
from steprl_jax.training.pack import pack
from steprl_jax.training.state import merge_model, split_model
from swirl_helpers import (CALCULATOR_ACTION, RewardServer, chain_model, hand_units, reward_config, smol_tokenizer,
                           tiny_config, tiny_model, unused_port)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return smol_tokenizer()


@pytest.fixture(scope="module")
def server():
    stub = RewardServer()
    yield stub
    stub.close()


@functools.partial(jax.jit, static_argnums=0)
def _logp_jit(graphdef, params, rest, tokens, mask, temperature):
    model = merge_model(graphdef, params, rest)
    return sequence_logprobs(model, tokens, attention_mask_bt=mask, temperature=temperature)


def _logprobs(model, sequences, temperature=1.0) -> list:
    """Per-token log-probs of each token list (`training.forward.sequence_logprobs`: entry t scores
    token t), through one compiled program: every call is padded to [2, 512]."""
    tokens, mask = np.zeros((2, 512), np.int32), np.zeros((2, 512), np.int32)
    for i, ids in enumerate(sequences):
        tokens[i, :len(ids)], mask[i, :len(ids)] = ids, 1
    graphdef, params, rest = split_model(model)
    logp = np.asarray(_logp_jit(graphdef, params, rest, tokens, mask, jnp.float32(temperature)))
    return [logp[i, :len(ids)] for i, ids in enumerate(sequences)]


def _params(model) -> dict:
    return {jax.tree_util.keystr(p): np.array(v) for p, v in
            jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


# ----------------------------------------------------------------------------- 1. units and rows
def _trajectory(judgements=None, query_id="q", tid="q#0", steps=None, outcome=None, process=None) -> Trajectory:
    """Prompt 1 2 3; steps with distinct ids and log-probs (log-prob of id x is -x / 100)."""
    steps = steps or [
        Step("<math_exp>2+3</math_exp>", [10, 11, 12], [-0.10, -0.11, -0.12], "\n2+3 -> 5\n", [20, 21],
             tool_calls=[{"name": "calculator", "arguments": {"expression": "2+3"}}], kind="math"),
        Step("<math_exp>5*4</math_exp>", [13, 14], [-0.13, -0.14], "\n5*4 -> 20\n", [22, 23, 24],
             tool_calls=[{"name": "calculator", "arguments": {"expression": "5*4"}}], kind="math"),
        Step("<answer>20</answer>", [15, 16], [-0.15, -0.16], kind="answer")]
    if judgements is None and (outcome is not None or process is not None):
        judgements = {"outcome": {"label": outcome}, "process": [{"label": l} for l in (process or [])]}
    return Trajectory(id=tid, query_id=query_id, question="What is (2+3)*4?", prompt_text="P", prompt_ids=[1, 2, 3],
                      steps=steps, judgements=judgements or {})


def test_units_are_exact_prefixes_and_sft_rows_train_only_actions():
    t = _trajectory()
    ids = t.all_ids()
    assert ids == [1, 2, 3, 10, 11, 12, 20, 21, 13, 14, 22, 23, 24, 15, 16]
    units = swirl.trajectory_units(t)
    assert [u.step_index for u in units] == [0, 1, 2]
    cursor = len(t.prompt_ids)
    for unit, step in zip(units, t.steps):
        assert list(unit.state_ids) == ids[:cursor]  # everything before the action, observations included
        assert list(unit.action_ids) == ids[cursor:cursor + len(step.action_ids)]
        # log-prob i belongs to action token i (here: -token / 100)
        assert list(unit.action_logprobs) == [-i / 100 for i in unit.action_ids]
        cursor += len(step.action_ids) + len(step.observation_ids)
    assert units[2].history_text == t.steps[0].action_text + t.steps[0].observation_text + \
        t.steps[1].action_text + t.steps[1].observation_text

    # SFT: one row for the trajectory; loss on action tokens only, observations are context.
    (row,) = sft_lib.trajectory_row(units)
    flat_ids, flat_loss = row.flat()[:2]
    assert flat_ids == ids
    actions = {10, 11, 12, 13, 14, 15, 16}
    assert [bool(x) for x in flat_loss] == [i in actions for i in ids]
    # A kept subset (step granularity dropped the middle step): its action is context, not trained.
    (row,) = sft_lib.trajectory_row([units[0], units[2]])
    flat_ids, flat_loss = row.flat()[:2]
    assert flat_ids == ids
    assert [i for i, x in zip(flat_ids, flat_loss) if x] == [10, 11, 12, 15, 16]
    batch = pack([row])
    assert np.asarray(batch.tokens)[0, :len(ids)].tolist() == ids
    assert np.asarray(batch.loss_mask)[0].tolist() == [float(i in (10, 11, 12, 15, 16)) for i in ids] + \
        [0.0] * (batch.tokens.shape[1] - len(ids))


class FakeSampler:
    """The Sampler calls Stage2Builder makes, answering with scripted generations (row j of the
    forked state gets `script[j]`)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def set_params(self, model):
        self.calls.append(("set_params", model))

    def prefill(self, prompts):
        self.calls.append(("prefill", prompts))
        return list(range(len(prompts)))

    def fork(self, state, rows):
        self.calls.append(("fork", list(rows)))
        return [state[r] for r in rows]

    def generate(self, state, key, *, max_new_tokens, params, stop):
        self.calls.append(("generate", len(state), max_new_tokens, params.temperature, tuple(stop)))
        return None, [self.script[j] for j in range(len(state))]


class FakeRewards:
    def __init__(self, values):
        self.values, self.items = values, []

    def score(self, items):
        self.items += items
        return [Reward(v, None if v is not None else "backend: down") for v in self.values]


def _gen(tokens, text):
    return Generation(tokens=np.asarray(tokens, np.int32), logprobs=-np.asarray(tokens, np.float32) / 100,
                      finish_reason="stop", text=text)


def test_stage2_rows_train_the_sampled_actions_only():
    units = swirl.trajectory_units(_trajectory())[:2]
    config = tiny_config("unused")
    script = [_gen([40, 41], "a"), _gen([42], "b"), _gen([43, 44, 45], "c"), _gen([], "")]  # G=2, 2 states
    rewards = FakeRewards([1.0, 0.0, 0.5, 0.7])  # the empty generation's reward is not used
    builder = swirl.Stage2Builder(swirl.Stage2Settings.from_config(config, ("</math_exp>",)), FakeSampler(script),
                                  None, rewards)
    policy = object()
    rows, metrics = builder(units, update=0, policy=policy)
    sampler = builder.sampler
    assert sampler.calls[0] == ("set_params", policy)  # the current policy, before sampling
    assert sampler.calls[1] == ("prefill", [list(u.state_ids) for u in units])
    assert sampler.calls[2] == ("fork", [0, 0, 1, 1])
    assert sampler.calls[3] == ("generate", 4, 16, 0.7, ("</math_exp>",))
    # the reward model sees the question, the state's history and the action: no reference answer
    assert [(i.question, i.state, i.action) for i in rewards.items] == [
        (units[j // 2].question, units[j // 2].history_text, a) for j, a in enumerate(["a", "b", "c", ""])]
    assert {f.name for f in dataclasses.fields(rewards.items[0])} == {"question", "state", "action"}
    assert metrics["samples"] == 4 and metrics["states"] == 2 and metrics["sampled_tokens"] == 6
    assert len(rows) == 2
    assert [len(r.branches) for r in rows] == [2, 1]  # the empty generation is dropped (no tokens to train)
    for row, unit in zip(rows, units):
        assert [list(s.ids) for s in row.prefix] == [list(unit.state_ids)] and not row.prefix[0].loss
    # RLOO: r - mean of the others; a group of one (the dropped sample left one) gets 0
    assert [b[0].advantage for b in rows[0].branches] == [1.0, -1.0]
    assert [b[0].advantage for b in rows[1].branches] == [0.0]

    batch = pack(rows)
    tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask)
    old, adv, branch = np.asarray(batch.old_logp), np.asarray(batch.advantages), np.asarray(batch.branch_ids)
    for r, (row, unit) in enumerate(zip(rows, units)):
        sampled = [t for b in row.branches for t in b[0].ids]
        assert tokens[r][mask[r] > 0].tolist() == sampled  # loss exactly on the sampled tokens
        assert np.all(mask[r][branch[r] == 0] == 0)  # never on the state
        np.testing.assert_allclose(old[r][mask[r] > 0], -np.asarray(sampled) / 100, rtol=1e-6)
        n = len(unit.state_ids)
        assert tokens[r, :n - 1].tolist() == list(unit.state_ids[:-1])
        # each branch starts with a copy of the state's last token, without loss
        starts = [i for i in range(1, tokens.shape[1]) if branch[r, i] > 0 and branch[r, i] != branch[r, i - 1]]
        assert [tokens[r, i] for i in starts] == [unit.state_ids[-1]] * len(row.branches)
        assert all(mask[r, i] == 0 for i in starts)
    assert adv[0][mask[0] > 0].tolist() == [1.0, 1.0, -1.0]


# ----------------------------------------------------------------------------- 2. filters
def _judged():
    def t(tid, q, outcome, process, calls=2):
        traj = _trajectory(tid=tid, query_id=q, outcome=outcome, process=process)
        if calls < 2:
            traj.steps[1].tool_calls = []
        return traj

    return [t("wrong_good", "q1", "false", ["GOOD", "GOOD", "GOOD"]),
            t("right_good", "q2", "true", ["GOOD", "GOOD", "GOOD"]),
            t("right_mixed", "q3", "true", ["GOOD", "BAD", "GOOD"]),
            t("wrong_mixed", "q4", "false", ["BAD", "GOOD", "BAD"]),
            t("right_failed_step", "q5", "true", ["GOOD", "failed", "GOOD"]),
            t("failed_outcome", "q6", "failed", ["GOOD", "GOOD", "GOOD"])]


def _kept(units):
    return sorted({u.trajectory_id for u in units})


def test_trajectory_filters_keep_what_the_paper_keeps():
    trajectories = _judged()
    units, stats = swirl.filter_units(trajectories, "none")
    assert len(units) == 18 and stats["kept_trajectories"] == 6
    assert stats["process_labels"] == {"GOOD": 14, "BAD": 3, "failed": 1}
    assert stats["outcome_labels"] == {"false": 2, "true": 3, "failed": 1}
    units, stats = swirl.filter_units(trajectories, "process")
    # a wrong answer whose every step is GOOD is kept; a step whose verdict failed is not GOOD
    assert _kept(units) == ["failed_outcome", "right_good", "wrong_good"]
    assert stats["kept_trajectories"] == 3 and stats["kept_units"] == 9
    _, stats = swirl.filter_units(trajectories[:-1], "process")
    assert stats["kept_trajectories"] == 2 and stats["kept_trajectories_with_wrong_answer"] == 1
    units, stats = swirl.filter_units(trajectories, "outcome")
    # the wrong answer is dropped, and so is an outcome whose verdict failed
    assert _kept(units) == ["right_failed_step", "right_good", "right_mixed"]
    assert stats["kept_trajectories_with_wrong_answer"] == 0 and len(units) == 9
    units, stats = swirl.filter_units(trajectories, "process_outcome")
    assert _kept(units) == ["right_good"] and len(units) == 3


def test_step_granularity_keeps_the_good_steps():
    trajectories = _judged()
    units, stats = swirl.filter_units(trajectories, "process", "step")
    kept = sorted((u.trajectory_id, u.step_index) for u in units)
    assert kept == sorted([("wrong_good", 0), ("wrong_good", 1), ("wrong_good", 2),
                           ("right_good", 0), ("right_good", 1), ("right_good", 2),
                           ("right_mixed", 0), ("right_mixed", 2), ("wrong_mixed", 1),
                           ("right_failed_step", 0), ("right_failed_step", 2),
                           ("failed_outcome", 0), ("failed_outcome", 1), ("failed_outcome", 2)])
    assert all(u.process_label == "GOOD" for u in units)
    _, stats = swirl.filter_units(trajectories[:-1], "process", "step")
    assert stats["kept_trajectories"] == 5 and stats["kept_trajectories_with_wrong_answer"] == 2
    units, _ = swirl.filter_units(trajectories, "process_outcome", "step")
    assert sorted((u.trajectory_id, u.step_index) for u in units) == [
        ("right_failed_step", 0), ("right_failed_step", 2), ("right_good", 0), ("right_good", 1),
        ("right_good", 2), ("right_mixed", 0), ("right_mixed", 2)]
    # missing verdicts (fewer process labels than steps) are not GOOD either
    short = _trajectory(tid="short", outcome="true", process=["GOOD"])
    units, _ = swirl.filter_units([short], "process", "step")
    assert [u.step_index for u in units] == [0]
    assert swirl.filter_units([short], "process", "trajectory")[0] == []
    with pytest.raises(ValueError, match="process_outcome"):
        swirl.filter_units(trajectories, "process+outcome")


def test_drop_easy_drops_questions_solved_with_at_most_one_call_every_time():
    def t(tid, q, outcome, calls):
        traj = _trajectory(tid=tid, query_id=q, outcome=outcome, process=["GOOD"] * 3)
        if calls < 2:
            traj.steps[1].tool_calls = []
        if calls < 1:
            traj.steps[0].tool_calls = []
        return traj

    trajectories = [t("easy#0", "easy", "true", 1), t("easy#1", "easy", "true", 0),
                    t("two_calls#0", "two_calls", "true", 1), t("two_calls#1", "two_calls", "true", 2),
                    t("one_wrong#0", "one_wrong", "true", 1), t("one_wrong#1", "one_wrong", "false", 1)]
    assert swirl.easy_questions(trajectories) == {"easy"}
    units, stats = swirl.filter_units(trajectories, "none", drop_easy=True)
    assert {u.query_id for u in units} == {"two_calls", "one_wrong"}
    assert stats["easy_questions_dropped"] == 1 and stats["kept_trajectories"] == 4
    units, stats = swirl.filter_units(trajectories, "none", drop_easy=False)
    assert stats["easy_questions_dropped"] == 0 and stats["kept_trajectories"] == 6


# ----------------------------------------------------------------------------- 3. advantages
def _reference(rewards, groups, kind, scale_by_std=False, eps=1e-6):
    out = np.zeros(len(rewards))
    for g in set(groups):
        members = [i for i in range(len(rewards)) if groups[i] == g and rewards[i] is not None]
        r = np.asarray([rewards[i] for i in members], np.float64)
        for k, i in enumerate(members):
            if kind == "zscore":
                out[i] = (r[k] - r.mean()) / (r.std() + eps)
            elif len(members) > 1:
                out[i] = r[k] - np.delete(r, k).mean()
                if scale_by_std:
                    out[i] /= r.std() + eps
    return out


def test_group_advantages_match_a_numpy_reference():
    rewards = [1.0, 0.0, 0.5, 0.25, None, 1.0, 0.0, 0.3, 0.3, 0.3, 0.9, None, 0.1, 0.8]
    groups = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    for kind, scale in (("rloo", False), ("rloo", True), ("zscore", False)):
        adv = group_advantages(rewards, groups, 5, kind, scale_by_std=scale)
        np.testing.assert_allclose(adv, _reference(rewards, groups, kind, scale), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{kind} scale_by_std={scale}")
        assert adv[4] == 0.0 and adv[11] == 0.0  # failed rewards
        for g in range(5):
            np.testing.assert_allclose(sum(adv[i] for i in range(len(groups)) if groups[i] == g), 0.0, atol=1e-5)
    rloo = group_advantages(rewards, groups, 5, "rloo")
    assert rloo[10] == 0.0  # group 3 is a group of one after the failed reward: no baseline, no signal
    np.testing.assert_allclose(rloo[:3], [1 - 0.25, 0 - 0.75, 0.5 - 0.5], rtol=1e-6)
    assert np.all(rloo[7:10] == 0.0)  # equal rewards


# ----------------------------------------------------------------------------- 7. end to end
@pytest.fixture(scope="module")
def e2e(tmp_path_factory, tok, server):
    workdir = tmp_path_factory.mktemp("swirl_e2e")
    config = tiny_config(workdir, reward_url=server.base_url)
    config.stages = "collect,judge,filter,train,sft,eval"
    config.swirl.train.kl_coef = 0.01  # the frozen reference policy's path too
    model = tiny_model(tok, seed=0)
    initial = _params(model)
    summary = swirl.run(config, (model, tok))
    return types.SimpleNamespace(workdir=str(workdir), config=config, settings=swirl.read_settings(config), model=model,
                                 initial=initial, summary=summary)


def _files(workdir):
    out = {}
    for folder, _, names in os.walk(workdir):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, workdir)] = path
    return out


def test_every_stage_writes_its_outputs(e2e, tok):
    w = e2e.workdir
    files = _files(w)
    for name in ("trajectories.jsonl", "judged.jsonl", "units/none_trajectory.jsonl",
                 "units/none_trajectory.stats.json", "policy/swirl/model.safetensors", "policy/sft/model.safetensors",
                 "eval/base.json", "eval/sft.json", "eval/swirl.json", "comparison.md", "curves.png",
                 "metrics.jsonl", "run.json"):
        assert name in files, name
    for stage in ("swirl", "sft"):
        assert any(n.startswith(f"tb/{stage}/events.out.tfevents") for n in files), stage
    for stage in ("swirl", "sft"):
        steps = sorted(int(d) for d in os.listdir(os.path.join(w, "checkpoints", stage)) if d.isdigit())
        assert steps and steps[-1] == 2, (stage, steps)
    records = RecordStore(os.path.join(w, "trajectories.jsonl")).load()
    assert sorted(collections.Counter(r.query_id for r in records).values()) == [2, 2]  # K=2 per question
    judged = RecordStore(os.path.join(w, "judged.jsonl")).load()
    assert all(len(t.judgements["process"]) == len(t.steps) and t.judgements["outcome"]["label"] for t in judged)
    stats = json.load(open(os.path.join(w, "units/none_trajectory.stats.json")))
    assert stats["kept_units"] == sum(len(t.steps) for t in judged) == len(read_units(e2e.settings.units_path))
    comparison = open(os.path.join(w, "comparison.md")).read()
    assert all(f"| {name} |" in comparison for name in ("base", "sft", "swirl"))
    assert os.path.getsize(os.path.join(w, "curves.png")) > 1000
    assert set(e2e.summary) == set(swirl.STAGES) and set(e2e.summary["eval"]) == {"base", "sft", "swirl"}

    ids = jnp.asarray([list(read_units(e2e.settings.units_path)[0].state_ids)[:32]])
    base_logits = np.asarray(e2e.model(ids))
    for name in ("swirl", "sft"):
        policy, policy_tok = load_pretrained(os.path.join(w, "policy", name))
        assert policy_tok("<math_exp>1</math_exp>")["input_ids"] == tok("<math_exp>1</math_exp>")["input_ids"]
        logits = np.asarray(policy(ids))
        assert logits.shape == base_logits.shape and np.abs(logits - base_logits).max() > 1e-4, name  # trained
    # train_offline trained copies: the caller's model is usable and unchanged
    assert all(np.array_equal(v, e2e.initial[k]) for k, v in _params(e2e.model).items())


def test_units_are_the_trajectories_tokens_and_logprobs(e2e):
    trajectories = {t.id: t for t in RecordStore(os.path.join(e2e.workdir, "trajectories.jsonl"))}
    units = read_units(e2e.settings.units_path)
    assert len(units) == sum(len(t.steps) for t in trajectories.values())
    temperature = swirl.policy_temperature(e2e.config)
    for unit in units:
        t = trajectories[unit.trajectory_id]
        assert list(unit.state_ids) == t.state_ids(unit.step_index)
        assert list(unit.action_ids) == t.steps[unit.step_index].action_ids
    # recorded log-probs are the base model's at the sampling temperature, token for token
    checked = [units[0], units[-1]]
    for unit, logp in zip(checked, _logprobs(e2e.model, [list(u.state_ids) + list(u.action_ids) for u in checked],
                                             temperature)):
        np.testing.assert_allclose(logp[len(unit.state_ids):], unit.action_logprobs, atol=1e-4)


def test_stage2_first_ratio_is_one_after_each_sampling(e2e):
    rows = read_metrics(e2e.workdir)["swirl"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["first_ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert r["first_ratio_min"] == pytest.approx(1.0, abs=1e-5)
        assert r["first_clipfrac"] == 0.0 and r["reward_failed"] == 0.0
        assert r["trained_tokens"] > 0 and r["samples"] == 4
    # the first update moved the policy (non-zero advantages), so update 2's ratio of 1 means the
    # sampler had the updated parameters; the KL to the frozen initial policy is 0, then not
    assert rows[0]["advantage_abs"] > 0 and rows[0]["grad_norm"] > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 1e-6


def test_a_second_run_redoes_nothing(e2e, tok):
    files = _files(e2e.workdir)
    keep = {n: open(p, "rb").read() for n, p in files.items()
            if n.endswith((".jsonl", ".safetensors", "stats.json", ".md")) or n.startswith("eval/")}
    steps = {s: sorted(os.listdir(os.path.join(e2e.workdir, "checkpoints", s))) for s in ("swirl", "sft")}
    summary = swirl.run(e2e.config, (e2e.model, tok))
    after = _files(e2e.workdir)
    for name, data in keep.items():
        assert open(after[name], "rb").read() == data, name  # no new records, the same exported policies
    assert {s: sorted(os.listdir(os.path.join(e2e.workdir, "checkpoints", s))) for s in ("swirl", "sft")} == steps
    assert summary["eval"] == e2e.summary["eval"]


# ----------------------------------------------------------------------------- 4. no tool in stage 2
def test_stage2_never_calls_a_tool(tmp_path, tok, monkeypatch):
    """The policy writes a complete calculator call after every state; the calculator and every
    tool registry raise if used. Stage 2 samples those calls and scores them, and no tool runs.
    (The reward stub gives no score, so that no train step is compiled for this test: the step
    is pure JAX; the e2e test trains.)"""
    from steprl_jax.agents.tasks import build_suite
    from steprl_jax.tools import calculator
    from steprl_jax.tools.protocol import Tool
    from steprl_jax.tools.registry import ToolRegistry

    tool_runs, executed = [], []

    def raising(**arguments):
        tool_runs.append(arguments)
        raise RuntimeError("a tool ran during stage 2")

    schema = calculator.calculator_tool().parameters
    monkeypatch.setattr(calculator, "calculator_tool", lambda name="calculator": Tool(name, "raises", schema, raising))
    original_execute = ToolRegistry.execute

    def guarded(self, calls):
        executed.append(calls)
        raise AssertionError(f"a tool registry executed {calls} during stage 2")

    monkeypatch.setattr(ToolRegistry, "execute", guarded)
    server = RewardServer(reply=lambda body: "No opinion.")
    try:
        config = tiny_config(tmp_path, reward_url=server.base_url, updates=1)
        settings = swirl.read_settings(config)
        write_units(settings.units_path, hand_units(config, tok))
        out = swirl.train(settings, chain_model(tok), tok)
    finally:
        server.close()
    assert out["updates"] == 1 and tool_runs == [] and executed == []
    assert len(server.requests) == 4  # batch 2 x G 2, each scored once
    assert all(CALCULATOR_ACTION in body["messages"][-1]["content"] for body in server.requests)
    assert out["reward_stats"]["failed/unparsed"] == 4
    (row,) = read_metrics(str(tmp_path))["swirl"]
    assert row["sampled_tokens"] == 4 * 14 and row["reward_failed"] == 4.0
    # Those actions were calculator calls, and this suite's registry does reach the raising tool.
    env = build_suite(config, split="train").env
    parsed = env.parse(CALCULATOR_ACTION)
    (result,) = original_execute(env.registry, env.calls_for(parsed))
    assert parsed.kind == "math" and tool_runs == [{"expression": "12+7"}] and not result.ok


# ----------------------------------------------------------------------------- 5./6. train steps and SFT
@pytest.fixture(scope="module")
def sft_setup(tok):
    """One compiled SFT step for every batch below: all are packed to [2, 512]."""
    config = tiny_config("unused")
    units = hand_units(config, tok)
    tx = make_optimizer(OptimizerConfig(learning_rate=3e-3, total_steps=100, max_grad_norm=None))
    graphdef, _, _ = split_model(tiny_model(tok, seed=2))
    step = make_train_step(graphdef, tx, TrainStepConfig(loss=sft_lib.LOSS))
    return types.SimpleNamespace(units=units, tx=tx, graphdef=graphdef, step=step)


def _batch(rows):
    return pack(rows, min_rows=2, min_length=512)


def _masked_nll(model, batch) -> float:
    """Mean NLL of the loss-mask tokens of a [2, 512] batch, from `sequence_logprobs`."""
    graphdef, params, rest = split_model(model)
    logp = np.asarray(_logp_jit(graphdef, params, rest, batch.tokens, batch.attention_mask, jnp.float32(1.0)))
    mask = np.asarray(batch.loss_mask)
    return float(-(logp * mask).sum() / mask.sum())


def test_sft_step_loss_is_the_mean_nll_of_the_action_tokens(tok, sft_setup):
    unit = sft_setup.units[1]  # the second step: its state holds an action and an observation
    model = tiny_model(tok, seed=5)
    rows = sft_lib.sft_rows([[unit]])
    assert len(rows) == 1
    ids = list(unit.state_ids) + list(unit.action_ids)
    logits = np.asarray(model(jnp.asarray([ids])), np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = len(unit.state_ids)
    expected = -np.mean([logp[n - 1 + j, a] for j, a in enumerate(unit.action_ids)])
    _, state, _ = create_train_state(copy_model(*split_model(model)), sft_setup.tx)
    state, metrics = sft_setup.step(state, _batch(rows))
    assert float(metrics["token_count"]) == len(unit.action_ids)
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["nll"]) == pytest.approx(expected, rel=1e-5)


def test_sft_updates_lower_the_nll_of_the_action_tokens(tok, sft_setup):
    model = tiny_model(tok, seed=6)
    batch = _batch(sft_lib.sft_rows(sft_lib.group_by_trajectory(sft_setup.units)))
    assert np.asarray(batch.loss_mask).sum() == sum(len(u.action_ids) for u in sft_setup.units)
    before = _masked_nll(model, batch)
    _, state, _ = create_train_state(copy_model(*split_model(model)), sft_setup.tx)
    losses = []
    for _ in range(4):
        state, metrics = sft_setup.step(state, batch)
        losses.append(float(metrics["loss"]))
    after = _masked_nll(merge_model(sft_setup.graphdef, state.params, state.rest), batch)
    assert losses[0] == pytest.approx(before, rel=1e-5)
    assert after < before - 0.5, (before, after, losses)
    assert losses == sorted(losses, reverse=True)


def test_sampler_and_reference_survive_donating_train_steps(tok, sft_setup):
    """Sample -> train -> set_params -> sample: the train step donates (deletes) its state's
    buffers, so the sampler and the frozen reference hold copies."""
    graphdef, step = sft_setup.graphdef, sft_setup.step
    model = tiny_model(tok, seed=7)
    initial = _params(model)
    _, state, _ = create_train_state(copy_model(*split_model(model)), sft_setup.tx)
    reference = copy_model(graphdef, state.params, state.rest)
    sampler = Sampler(model, tok, max_context=1024)
    batch = _batch(sft_lib.sft_rows(sft_lib.group_by_trajectory(sft_setup.units)))
    prompt = list(sft_setup.units[0].state_ids)

    def sample_and_rescore(policy_model, seed):
        _, (gen,) = sampler.generate(sampler.prefill([prompt]), jax.random.PRNGKey(seed), max_new_tokens=6,
                                     params=SamplingParams(temperature=1.0))
        (logp,) = _logprobs(policy_model, [prompt + gen.tokens.tolist()])
        np.testing.assert_allclose(gen.logprobs, logp[len(prompt):], atol=1e-4)

    for update in range(2):
        policy = copy_model(graphdef, state.params, state.rest)
        sampler.set_params(policy)
        sample_and_rescore(policy, update)
        donated = jax.tree.leaves(state.params)
        for _ in range(2):
            state, _ = step(state, batch)
        assert all(x.is_deleted() for x in donated)  # the step really took the buffers
        sample_and_rescore(policy, 10 + update)  # the sampler's copy outlived them
    np.testing.assert_allclose(_masked_nll(reference, batch), _masked_nll(model, batch), rtol=1e-6)
    assert _masked_nll(merge_model(graphdef, state.params, state.rest), batch) < _masked_nll(reference, batch)
    assert all(np.array_equal(v, initial[k]) for k, v in _params(model).items())  # the caller's model


# ----------------------------------------------------------------------------- 8. bad input
def test_a_corrupt_units_file_names_its_file_and_line(tmp_path, tok):
    config = tiny_config(tmp_path)
    path = swirl.read_settings(config).units_path
    write_units(path, hand_units(config, tok)[:3])
    good = open(path).read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join([good[0], good[1][:40], good[2]]) + "\n")
    with pytest.raises(UnitsError, match=rf"{path}:2: invalid JSON"):
        read_units(path)
    with pytest.raises(UnitsError, match=rf"{path}:2: invalid JSON"):  # the stage says it too
        swirl.run(_with(config, stages="train"), (None, tok))
    data = json.loads(good[0])
    del data["action_ids"]
    with open(path, "w") as f:
        f.write("\n".join([json.dumps(data), good[1]]) + "\n")
    with pytest.raises(UnitsError, match=rf"{path}:1: missing fields \['action_ids'\]"):
        read_units(path)
    data = json.loads(good[1])
    data["action_logprobs"] = data["action_logprobs"][:-1]
    with open(path, "w") as f:
        f.write("\n".join([good[0], "", json.dumps(data)]) + "\n")
    with pytest.raises(UnitsError, match=rf"{path}:3: .*one log-prob per action token"):
        read_units(path)


def _with(config, **fields):
    config = config.copy_and_resolve_references()
    for dotted, value in fields.items():
        *parents, leaf = dotted.split("__")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config


def test_incompatible_resume_missing_inputs_and_unknown_stages(tmp_path):
    config = tiny_config(tmp_path)
    nothing = (None, None)  # no stage below gets as far as using a model
    with pytest.raises(FileNotFoundError, match="judged.jsonl.*run the 'judge' stage first"):
        swirl.run(_with(config, stages="filter"), nothing)
    with pytest.raises(FileNotFoundError, match="trajectories.jsonl.*run the 'collect' stage first"):
        swirl.run(_with(config, stages="judge"), nothing)
    for stage in ("train", "sft"):
        with pytest.raises(UnitsError, match="none_trajectory.jsonl: no units file.*'filter' stage"):
            swirl.run(_with(config, stages=stage), nothing)
    with pytest.raises(IncompatibleRunError, match=r"swirl\.samples_per_question: recorded 2, now 3"):
        swirl.run(_with(config, stages="filter", swirl__samples_per_question=3), nothing)
    with pytest.raises(IncompatibleRunError, match=r"model\.source: recorded 'smollm2-135m-instruct', now 'other'"):
        swirl.run(_with(config, stages="filter", model__source="other"), nothing)
    with pytest.raises(ValueError, match="unknown stage.*'evaluate'.*valid: collect, judge, filter, train, sft, eval"):
        swirl.run(_with(config, stages="collect,evaluate"), nothing)
    with pytest.raises(ValueError, match="config.swirl.filter"):
        swirl.run(_with(config, swirl__filter="process+outcome"), nothing)


def test_unknown_job_lists_the_valid_jobs(tmp_path):
    from steprl_jax import main

    with pytest.raises(ValueError, match="unknown job 'swirll'; valid jobs: evaluate, rl, swirl"):
        main.run(_with(tiny_config(tmp_path), job="swirll"))


def test_an_unknown_config_field_fails_on_the_command_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "steprl_jax.main", "--config=configs/swirl_arithmetic.py",
                          f"--config.workdir={workdir}", "--config.nonexistent=1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    # one line, bad input's exit status; it stopped while parsing the flags: no job started, no workdir
    assert out.returncode == 2 and out.stderr == "error: no such config field: 'nonexistent'\n", out.stderr
    assert not workdir.exists()
    out = subprocess.run([sys.executable, "-m", "steprl_jax.main", "--config=configs/swirl_arithmetic.py",
                          "--config.swirl.train.updats=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and 'Did you mean "updates"' in out.stderr and "Traceback" not in out.stderr


def test_a_reward_endpoint_that_is_down_drops_every_sample(tmp_path, tok):
    config = tiny_config(tmp_path, updates=1)
    config.reward = reward_config(f"http://127.0.0.1:{unused_port()}/v1", retries=1, timeout_s=2.0)
    settings = swirl.read_settings(config)
    write_units(settings.units_path, hand_units(config, tok))
    out = swirl.train(settings, tiny_model(tok, seed=8), tok)
    assert out["reward_stats"]["failed"] == 4 and out["reward_stats"].get("scored", 0) == 0
    assert out["reward_stats"]["failed/backend"] == 4
    (row,) = read_metrics(str(tmp_path))["swirl"]
    assert row["skipped"] == 1.0 and row["reward_failed"] == 4.0 and row["samples"] == 4.0
    # Nothing was trained: no policy is exported under SWiRL's name, but the data position is saved.
    assert out["train_steps"] == 0
    assert not os.path.exists(os.path.join(tmp_path, "policy", "swirl"))
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "swirl", "1"))
