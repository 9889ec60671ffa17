"""A collection stopped after k episodes and resumed with the rest (their indices in the whole run,
as swirl.collect and the evaluation runner resume), against the uninterrupted run: a tiny random
model at temperature 1, where a draw near a token boundary flips on last-bit differences."""

import pytest

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.data.arithmetic import arithmetic_problems
from steprl_jax.sampling import Sampler
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.registry import ToolRegistry
from swirl_helpers import smol_tokenizer, tiny_model

BATCH = 16  # more rows than episodes: the default batch size, a small collection
STOPS = (1, 2, 3)  # records on disk when the run was stopped


@pytest.fixture(scope="module")
def runs():
    """(uninterrupted records, {k: records of the run resumed after k}, decode widths of each run)."""
    tokenizer = smol_tokenizer()
    sampler = Sampler(tiny_model(tokenizer), tokenizer, max_context=1024)
    widths = []
    generate = sampler.generate

    def spy(*args, **kwargs):
        state, generations = generate(*args, **kwargs)
        widths[-1].add(state.batch_bucket)
        return state, generations

    sampler.generate = spy
    examples = [p.demonstration() for p in arithmetic_problems(4, seed=10_007)[1:2]]
    env = TaggedEnv(ToolRegistry([calculator_tool()]), examples=examples)
    episodes = [(f"{p.id}#{e}", Task(p.id, p.question, p.answer)) for p in arithmetic_problems(2, seed=0)
                for e in range(2)]
    config = RolloutConfig(max_steps=3, max_new_tokens=48, max_context=1024, temperature=1.0, batch_size=BATCH)

    def run(indices):
        widths.append(set())
        engine = RolloutEngine(sampler, tokenizer, env, config, seed=7)
        try:
            return list(engine.run([episodes[i] for i in indices], indices=indices))
        finally:
            engine.close()

    whole = run(list(range(len(episodes))))
    order = [t.id for t in whole]  # the order they ended in, which is the order they are recorded in
    resumed = {}
    for k in STOPS:
        rest = [i for i, (episode_id, _) in enumerate(episodes) if episode_id not in order[:k]]
        resumed[k] = run(rest)
    return {t.id: t for t in whole}, {k: {t.id: t for t in r} for k, r in resumed.items()}, widths


def test_a_resumed_run_decodes_at_the_width_of_the_uninterrupted_one(runs):
    """XLA's numbers for a row change with the batch width, so the engine decodes at its configured
    width however many episodes are left (before: 4 rows uninterrupted, 3, 2, 1 resumed)."""
    whole, resumed, widths = runs
    assert widths == [{BATCH}] * (1 + len(STOPS))
    for k, records in resumed.items():
        assert len(records) == len(whole) - k and set(records) < set(whole)
        for episode_id, record in records.items():
            assert record.prompt_ids == whole[episode_id].prompt_ids


# Strict: once resuming is exact this passes, and the mark must go.
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "a row's logits change in their last bits with which cache slots hold its keys (all rows share the "
    "slot index: its batch-mates' tokens decide) and with the cache length, so a draw near a token "
    "boundary can flip after a resume"))
def test_a_resumed_run_samples_what_the_uninterrupted_run_sampled(runs):
    whole, resumed, _ = runs
    for k, records in resumed.items():
        for episode_id, record in records.items():
            expected = whole[episode_id]
            assert [s.action_ids for s in record.steps] == [s.action_ids for s in expected.steps], (k, episode_id)
            assert [s.action_logprobs for s in record.steps] == [s.action_logprobs for s in expected.steps], \
                (k, episode_id)
