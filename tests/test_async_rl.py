"""Asynchronous rollouts (algorithms/async_loop.py): the policy version of every sampled token,
the off-policy correction's weights and update, the driver at staleness 0 against the synchronous
loop bit for bit, stale work dropped and counted, and in-flight weight pushes. The killed and
resumed asynchronous run is in test_rl_resume.py."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_helpers import VerdictServer, tiny_rl_config
from steprl_jax.algorithms import online
from steprl_jax.algorithms.async_loop import AsyncRun, AsyncSettings, tree_version
from steprl_jax.ops import losses
from steprl_jax.training.metrics_log import read_metrics
from swirl_helpers import smol_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


# ------------------------------------------------------------------ versions
def test_every_token_records_the_version_that_sampled_it_and_a_push_between_calls_shows_where(tokenizer):
    from steprl_jax.sampling import Sampler, SamplingParams

    sampler = Sampler(tiny_model(tokenizer, seed=0), tokenizer, max_context=256)
    assert sampler.version == 0
    state = sampler.prefill([tokenizer.encode("Hello there")])
    key = jax.random.PRNGKey(0)
    params = SamplingParams(temperature=1.0)
    no_eos = []  # no stop token: the row runs to its budget
    state, (first,) = sampler.generate(state, key, max_new_tokens=10, params=params, max_steps=4,
                                       stop_token_ids=no_eos)
    assert first.finish_reason == "running" and list(first.versions) == [0] * 4
    sampler.set_params(tiny_model(tokenizer, seed=1), version=7)  # lands between two decode calls
    state, (done,) = sampler.generate(state, key, max_new_tokens=10, params=params, running=[first],
                                      stop_token_ids=no_eos)
    assert list(done.versions) == [0] * 4 + [7] * 6 and len(done.tokens) == 10
    sampler.set_params(tiny_model(tokenizer, seed=2))  # default: the next version
    assert sampler.version == 8


def test_a_tree_is_as_old_as_its_oldest_token():
    from steprl_jax.agents.records import Step, TreeNode, TreeRecord

    step = lambda versions: Step("a", [1] * len(versions), [0.0] * len(versions), action_versions=versions)
    tree = TreeRecord("t", "q", "?", "", [1], nodes=[TreeNode(-1, step([3, 3]), 1), TreeNode(0, step([3, 4]), 2)])
    assert tree_version(tree) == 3
    assert tree_version(TreeRecord("t", "q", "?", "", [1], nodes=[TreeNode(-1, Step("a", [1], [0.0]), 1)])) is None


# ------------------------------------------------------------------ the correction
def test_truncated_importance_weights_by_hand():
    prox = jnp.log(jnp.array([[1.0, 0.5, 0.9, 0.2]]))
    behaviour = jnp.log(jnp.array([[1.0, 0.25, 0.3, 0.4]]))
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0]])
    weights, sums = losses.truncated_is_weights(prox, behaviour, mask, cap=2.0)
    # 0.5/0.25 = 2 (at the cap, not past it), 0.9/0.3 = 3 -> 2, 0.2/0.4 = 0.5; column 0 off the mask
    np.testing.assert_allclose(np.asarray(weights), [[0.0, 2.0, 2.0, 0.5]], rtol=1e-6)
    assert float(sums["is_truncated"]) == 1.0 and float(sums["token_count"]) == 3.0
    assert float(sums["is_weight_max"]) == pytest.approx(3.0, rel=1e-6)
    assert float(sums["is_weight"]) == pytest.approx(4.5, rel=1e-6)
    with pytest.raises(ValueError, match="cap must be > 0"):
        losses.truncated_is_weights(prox, behaviour, mask, cap=0.0)


def test_the_weight_scales_each_tokens_surrogate_and_carries_no_gradient():
    logp = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    old = jnp.log(jnp.array([[0.5, 0.5, 0.4]]))
    adv = jnp.array([[0.0, 1.0, -1.0]])
    mask = jnp.array([[0.0, 1.0, 1.0]])
    w = jnp.array([[0.0, 0.5, 2.0]])

    def loss(lp, weights):
        total, denom, _ = losses.policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2, is_weight_bt=weights)
        return total / denom

    plain = jax.grad(lambda lp: loss(lp, None))(logp)
    weighted, weight_grad = jax.grad(loss, argnums=(0, 1))(logp, w)
    np.testing.assert_allclose(np.asarray(weighted), np.asarray(plain * w), rtol=1e-6)
    assert not np.any(np.asarray(weight_grad))


def _rows(tokenizer, logprob_of=None):
    """Two rows of a prompt and a trained action, with the given behaviour log-probs per action."""
    from steprl_jax.training.pack import Row, Span

    rows = []
    for k, (prompt, action, advantage) in enumerate([("What is 2+2?", " It is 4.", 1.0),
                                                    ("Name a colour.", " Blue, I think.", -1.0)]):
        p, a = tokenizer.encode(prompt), tokenizer.encode(action, add_special_tokens=False)
        lp = [-1.0] * len(a) if logprob_of is None else logprob_of(k, p, a)
        rows.append(Row([Span(p), Span(a, loss=True, logprobs=lp, advantage=advantage)]))
    return rows


def _learner(tokenizer, tmp_path, cap):
    from steprl_jax.training.config import LossConfig, OptimizerConfig
    from steprl_jax.training.learner import Learner, LearnerSettings

    settings = LearnerSettings(LossConfig(kind="policy"), OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
                               behaviour_cap=cap)
    return Learner(tiny_model(tokenizer, seed=3), settings, seed=0, checkpoint_dir=str(tmp_path / str(cap)))


def test_on_fresh_data_the_corrected_update_is_the_plain_one_and_stale_data_is_reweighted(tokenizer, tmp_path):
    from steprl_jax.training.pack import pack

    # the learner's own log-probs as the behaviour's: data sampled by the policy being trained
    probe = _learner(tokenizer, tmp_path, 2.0)
    batch = pack(_rows(tokenizer))
    own = np.asarray(probe.logprob_fn(probe.state.params, probe.state.rest, batch.tokens, batch.attention_mask,
                                      batch.loss_mask))

    def fresh(k, prompt, action):
        start = len(prompt)
        return [float(x) for x in own[k, start:start + len(action)]]

    plain, corrected = _learner(tokenizer, tmp_path, None), _learner(tokenizer, tmp_path, 2.0)
    m_plain = plain.update(_rows(tokenizer, fresh))
    assert "is_weight_mean" not in m_plain
    m_corrected = corrected.update(_rows(tokenizer, fresh))
    assert m_corrected["is_weight_mean"] == 1.0 and m_corrected["is_truncated"] == 0.0
    assert m_corrected["first_ratio"] == 1.0 and m_corrected["first_clipfrac"] == 0.0
    for a, b in zip(jax.tree.leaves(plain.state.params), jax.tree.leaves(corrected.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # stale: the behaviour gave every token 4x less probability than the learner now does
    stale = _learner(tokenizer, tmp_path, 2.0)
    m = stale.update(_rows(tokenizer, lambda k, p, a: [x - np.log(4.0) for x in fresh(k, p, a)]))
    assert m["is_weight_mean"] == pytest.approx(2.0) and m["is_truncated"] == 1.0
    assert m["is_weight_max"] == pytest.approx(4.0, rel=1e-4)
    assert m["first_ratio"] == pytest.approx(1.0, abs=1e-6)  # the clip's reference is the proximal policy


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_first_step_reads_the_proximal_policy_from_its_own_forward_pass(tokenizer, tmp_path, minibatches):
    """The fused first step (LossConfig.proximal_cap) makes the update a separate log-prob pass
    makes (test_train_step's pass is another program: equal to float32 rounding), with the same
    weights' metrics; with two minibatches the second is corrected by the separate pass."""
    def stale(k, prompt, action):  # around the tiny model's log-probs (~ -log vocab): some weights past the cap
        return [-8.0 - 1.0 * ((i + k) % 7) for i in range(len(action))]

    runs = {}
    for fused in (True, False):
        learner = _learner(tokenizer, tmp_path / f"{minibatches}{fused}", 2.0)
        learner.settings = dataclasses.replace(learner.settings, minibatches=minibatches)
        assert learner.proximal_step_fn is not None
        if not fused:
            learner.proximal_step_fn = None
        runs[fused] = learner.update(_rows(tokenizer, stale) * 2), learner.state.params
    (m_fused, p_fused), (m_plain, p_plain) = runs[True], runs[False]
    assert m_fused["first_ratio"] == 1.0  # exactly: the clip's reference is the step's own log-prob
    for key in ("is_weight_mean", "is_weight_max", "is_truncated", "loss", "first_clipfrac"):
        assert m_fused[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-6), key
    assert 0.0 < m_fused["is_truncated"] < 1.0
    for a, b in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ the driver
def _run(tmp_path, name, tokenizer, server, *, settings=None, **rl):
    c = tiny_rl_config(tmp_path / name, "portool", server.base_url, iterations=3, **rl)
    c.rl.eval.num_tasks = 0
    c.rl.skip_update_without_signal = False
    if settings is not None:
        c.rl.asynchronous.max_staleness = settings.max_staleness
        c.rl.asynchronous.in_flight = settings.in_flight
    loop = online.build_loop(c, tiny_model(tokenizer, seed=5), tokenizer)
    try:
        if settings is None:
            loop.run()
        else:
            AsyncRun(loop, settings).run(0, 0, [])
        params = [np.asarray(x) for x in jax.tree.leaves(loop.learner.state.params)]
    finally:
        loop.close()
    return params, read_metrics(str(tmp_path / name))["rl"]


def _records(tmp_path, name, iteration):
    """The iteration's rollout records, without the steps' timings (generate_s, tool_s)."""
    with open(tmp_path / name / "rollouts" / f"iter_{iteration:05d}.jsonl") as f:
        trees = [json.loads(line) for line in f]
    for tree in trees:
        for node in tree["nodes"]:
            node["step"] = {k: v for k, v in node["step"].items() if not k.endswith("_s")}
    return trees


def test_the_driver_at_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path, tokenizer):
    server = VerdictServer()
    try:
        sync_params, sync_rows = _run(tmp_path, "sync", tokenizer, server)
        async_params, async_rows = _run(tmp_path, "async0", tokenizer, server,
                                        settings=AsyncSettings(max_staleness=0, is_cap=0.0))
    finally:
        server.close()
    for a, b in zip(sync_params, async_params):
        np.testing.assert_array_equal(a, b)
    for it in range(3):
        assert _records(tmp_path, "sync", it) == _records(tmp_path, "async0", it)
    for s, a in zip(sync_rows, async_rows):
        assert s["loss"] == a["loss"] and s["reward_mean"] == a["reward_mean"] and a["staleness"] == 0.0


def test_in_flight_pushes_reach_the_sampler_and_every_batch_stays_within_its_staleness(tmp_path, tokenizer):
    server = VerdictServer()
    try:
        _, rows = _run(tmp_path, "inflight", tokenizer, server, settings=AsyncSettings(max_staleness=1, in_flight=True))
    finally:
        server.close()
    assert len(rows) == 3 and all(r["stale_dropped"] == 0 and r["staleness"] <= 1 for r in rows)
    assert all(0 < r["is_weight_mean"] <= 2.0 and "is_truncated" in r for r in rows)
    for it in range(3):  # iteration i may only start once version i - 1 exists
        versions = [v for t in _records(tmp_path, "inflight", it) for n in t["nodes"]
                    for v in n["step"]["action_versions"]]
        assert versions and it - 1 <= min(versions) and max(versions) <= it


def test_work_older_than_the_bound_is_dropped_and_counted():
    from steprl_jax.agents.records import Step, TreeNode, TreeRecord

    def tree(version):
        step = Step("a", [1], [0.0], action_versions=[version])
        return TreeRecord(f"t{version}", "q", "?", "", [1], nodes=[TreeNode(-1, step, 1)])

    run = AsyncRun(None, AsyncSettings(max_staleness=1))
    kept, dropped, oldest = run._fresh([tree(5), tree(3), tree(4)], version=5)
    assert [t.id for t in kept] == ["t5", "t4"] and dropped == 1 and oldest == 4


# ------------------------------------------------------------------ the benchmark's judge
def test_the_benchmark_judge_answers_by_the_tool_world_rule_over_http_after_its_latency():
    from steprl_jax.agents.records import Step
    from steprl_jax.benchmarks.verdict_server import VerdictServer, verdict
    from steprl_jax.judges.http_backend import HttpChatBackend
    from steprl_jax.judges.items import step_messages
    from steprl_jax.judges.prompts import trajectory_messages

    def prompt(answer, failed=False):
        call = f'<think>done</think><tool_call>[{{"name": "response_gen", "arguments": {{"answer": "{answer}"}}}}]' \
               '</tool_call>'
        lookup = Step("<think>look</think><tool_call>[]</tool_call>", [1], [0.0],
                      tool_results=[{"name": "get_price", "error": {"type": "tool_failure", "message": "down"}}]
                      if failed else [{"name": "get_price", "content": "41.5"}])
        return trajectory_messages("What was the price?", step_messages([lookup, Step(call, [1], [0.0])]), "41.5")

    assert verdict(prompt("41.5")) == "Verdict: true"
    assert verdict(prompt("12")) == "Verdict: false"
    assert verdict(prompt("I cannot tell: the tool failed", failed=True)) == "Verdict: unable_to_answer"
    assert verdict([{"role": "user", "content": "hello"}]) == "Verdict: false"
    with VerdictServer(latency_s=0.0) as server:
        backend = HttpChatBackend(server.base_url, "rule", timeout_s=10.0)
        assert backend.chat(prompt("41.5"), 2, 0.0, 16) == ["Verdict: true"] * 2


def test_dynamic_sampling_and_batches_without_signal_work_one_version_behind(tmp_path, tokenizer):
    """DAPO rolls out more queries for the groups it drops inside the rollout thread, and an
    iteration left with nothing to train on skips its update; the learner still takes every
    iteration in order and the run ends."""
    from steprl_jax.agents.tasks import build_suite
    from steprl_jax.algorithms.offline import items_at

    c = tiny_rl_config(tmp_path / "dapo", "dapo", "", iterations=2)
    c.rl.eval.num_tasks = 0
    first = items_at(build_suite(c, split="train").tasks, 0, 1, int(c.seed))[0]
    # the first query drawn: every answer true (its group dropped); every other answer false
    server = VerdictServer(lambda body: "Verdict: true" if first.question in json.dumps(body["messages"])
                           else "Verdict: false")
    try:
        from rl_helpers import judge_http

        judge_http(c, server.base_url)
        c.rl.asynchronous.max_staleness = 1
        c.rl.dapo.max_sampling_rounds = 2
        loop = online.build_loop(c, tiny_model(tokenizer, seed=5), tokenizer)
        try:
            before = [np.asarray(x) for x in jax.tree.leaves(loop.learner.state.params)]
            loop.run()
            after = [np.asarray(x) for x in jax.tree.leaves(loop.learner.state.params)]
        finally:
            loop.close()
    finally:
        server.close()
    rows = read_metrics(str(tmp_path / "dapo"))["rl"]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["groups_dropped"] >= 1 and rows[0]["sampling_rounds"] == 2  # it rolled out more queries
    assert all(r["skipped"] == 1.0 for r in rows)  # every kept group all false: nothing to learn
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_the_benchmarks_overlap_bound_is_what_perfect_overlap_of_the_sync_phases_gives():
    from steprl_jax.benchmarks.async_rl import overlap_bound

    # iteration 1 is not timed; then rollout 100 s + train 50 s, and rollout 60 s + train 60 s:
    # (150 + 120) s in turn against (100 + 60) s overlapped
    sync = {"rollout_s": [500.0, 100.0, 60.0], "train_s": [9.0, 50.0, 60.0]}
    assert overlap_bound(sync) == pytest.approx(270 / 160)
