"""A collection stopped after k episodes and resumed (`RolloutEngine.run_in_waves`, as swirl.collect
and the evaluation runner resume) against the uninterrupted run: a tiny random model at temperature
1, where a draw near a token boundary flips on last-bit differences. Resuming with only the episodes
left (the way runs resumed before) is shown to diverge, so the exact comparison can fail."""

import jax
import pytest

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.data.arithmetic import arithmetic_problems
from steprl_jax.sampling import Sampler
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.registry import ToolRegistry
from swirl_helpers import smol_tokenizer, tiny_model

STOPS = (1, 2, 3)  # records on disk when the run was stopped


def _sampled(records) -> dict:
    return {t.id: [(s.action_ids, s.action_logprobs) for s in t.steps] for t in records}


def _setup():
    tokenizer = smol_tokenizer()
    sampler = Sampler(tiny_model(tokenizer), tokenizer, max_context=1024)
    examples = [p.demonstration() for p in arithmetic_problems(4, seed=10_007)[1:2]]
    env = TaggedEnv(ToolRegistry([calculator_tool()]), examples=examples)
    episodes = [(f"{p.id}#{e}", Task(p.id, p.question, p.answer)) for p in arithmetic_problems(3, seed=0)
                for e in range(2)]
    return tokenizer, sampler, env, episodes


@pytest.fixture(scope="module")
def runs():
    """(uninterrupted records, {k: records added by the run resumed after k, in waves},
    {k: records of the remaining episodes run alone}), 6 episodes in waves of 4 on 2 rows."""
    tokenizer, sampler, env, episodes = _setup()
    config = RolloutConfig(max_steps=3, max_new_tokens=48, max_context=1024, temperature=1.0, batch_size=2)

    def engine():
        return RolloutEngine(sampler, tokenizer, env, config, seed=7)

    def in_waves(done):
        e = engine()
        try:
            return list(e.run_in_waves(episodes, done, wave=4))
        finally:
            e.close()

    def alone(done):
        e = engine()
        try:
            rest = [i for i, (episode_id, _) in enumerate(episodes) if episode_id not in done]
            return list(e.run([episodes[i] for i in rest], indices=rest,
                              run_key=jax.random.split(e.key)[1]))  # the same run key
        finally:
            e.close()

    whole = in_waves(set())
    order = [t.id for t in whole]  # the order they ended in, which is the order they are recorded in
    resumed = {k: in_waves(set(order[:k])) for k in STOPS}
    remainder = {k: alone(set(order[:k])) for k in STOPS}
    return _sampled(whole), {k: _sampled(r) for k, r in resumed.items()}, \
        {k: _sampled(r) for k, r in remainder.items()}, order


def test_a_resumed_run_samples_what_the_uninterrupted_run_sampled(runs):
    whole, resumed, _, order = runs
    assert len(whole) == 6
    for k, records in resumed.items():
        assert set(records) == set(whole) - set(order[:k])  # nothing lost, nothing twice
        for episode_id, sampled in records.items():
            assert sampled == whole[episode_id], (k, episode_id)  # token ids and log-probs, exactly


def test_the_remaining_episodes_run_alone_differ_which_is_why_waves_run_whole(runs):
    whole, _, remainder, _ = runs
    differ = [(k, episode_id) for k, records in remainder.items() for episode_id, sampled in records.items()
              if sampled != whole[episode_id]]
    assert differ  # the comparison above is not vacuous: other batch-mates change the numbers


def test_the_overlapping_schedule_runs_every_episode_once():
    """rollout.deterministic=False: rows decode while tools run (which rows join a call is up to
    timing, so no exactness is claimed); every episode still ends once, with its steps."""
    tokenizer, sampler, env, episodes = _setup()
    config = RolloutConfig(max_steps=3, max_new_tokens=48, max_context=1024, temperature=1.0, batch_size=2,
                           deterministic=False)
    engine = RolloutEngine(sampler, tokenizer, env, config, seed=7)
    try:
        records = list(engine.run_in_waves(episodes, set(), wave=4))
    finally:
        engine.close()
    assert sorted(t.id for t in records) == sorted(e for e, _ in episodes)
    assert all(t.steps and t.termination for t in records)
