"""Observations that do not fit the sampler's cache end their episode with "context"; nothing crashes.

All rows of a sampler state share cache slot indices, so an append is bounded by the longest row
still in the state, not by the appending row's own length. A tiny random model (the SmolLM2
tokenizer, 512 positions) and prompts / observations sized around that limit reproduce both cases:
a finished long episode that blocks the others, and an observation that does not fit beside a
longer live episode.
"""
import pytest
from flax import nnx

from steprl_jax.agents.environments import TaggedEnv, Task
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.models import ModelConfig, Transformer
from steprl_jax.models.gguf_io import read_gguf_tokenizer
from steprl_jax.models.pretrained import resolve_source
from steprl_jax.sampling import Sampler
from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.registry import ToolRegistry
from steprl_jax.agents.schedules import tree as tree_schedule
from steprl_jax.agents.schedules.tree import TreeSettings

CONTEXT = 512  # positions per row, and the cache cap (its bucket)
NEW = 8  # tokens per action
ERROR = 43  # tokens of the invalid-action observation every other episode gets
ROLLOUT = dict(max_new_tokens=NEW, max_context=CONTEXT, temperature=0.0, batch_size=6)


class LongPageEnv(TaggedEnv):
    """The tag format, where every action of the task "long" gets a long page back (a search tool
    returning a whole document); a random model's actions elsewhere are invalid (an error)."""

    page = "\nPage: " + "lorem ipsum " * 60

    def outcome(self, task, parsed, results):
        outcome = super().outcome(task, parsed, results)
        if task.id == "long":
            outcome.observation_text = self.page
        return outcome


@pytest.fixture(scope="module")
def parts():
    tokenizer = read_gguf_tokenizer(resolve_source("smollm2-135m-instruct"))
    config = ModelConfig.tiny("llama", vocab_size=len(tokenizer), max_position_embeddings=CONTEXT,
                              eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    # Prompts held whole in every row (no shared segment): the system prompt they share would
    # otherwise be held once, and the page would fit beside big's row.
    sampler = Sampler(Transformer(config, rngs=nnx.Rngs(0)), tokenizer, max_context=CONTEXT, min_shared_prefix=0)
    return sampler, tokenizer, LongPageEnv(ToolRegistry([calculator_tool()]))


def _engine(parts, max_steps):
    sampler, tokenizer, env = parts
    return RolloutEngine(sampler, tokenizer, env, RolloutConfig(max_steps=max_steps, **ROLLOUT), seed=0)


def _task(engine, task_id, repeats=0):
    task = Task(task_id, "What is 2 + 3?" + " Think carefully." * repeats, "5")
    return task, len(engine.prompt(task)[1])


def test_a_finished_long_episode_does_not_block_the_others(parts):
    engine = _engine(parts, max_steps=3)
    huge, huge_prompt = _task(engine, "huge", repeats=118)
    plain, plain_prompt = _task(engine, "plain")
    # huge ends after its first action (its observation would pass the context), but its row still
    # reaches so far that plain's observation finds no free slot until that row is dropped.
    assert huge_prompt + 2 * NEW + ERROR > CONTEXT
    assert huge_prompt + NEW - 1 + ERROR > CONTEXT >= huge_prompt + NEW
    assert plain_prompt + 3 * (NEW + ERROR) < CONTEXT
    by_id = {t.query_id: t for t in engine.run([("e0", huge), ("e1", plain)])}
    assert by_id["huge"].termination == "context" and len(by_id["huge"].steps) == 1
    assert by_id["plain"].termination == "step_cap" and len(by_id["plain"].steps) == 3
    assert [len(s.observation_ids) for s in by_id["plain"].steps] == [ERROR] * 3


def _long_page_tasks(engine):
    big, big_prompt = _task(engine, "big", repeats=60)
    long, long_prompt = _task(engine, "long")
    plain, _ = _task(engine, "plain")
    page = len(engine.env.observation_ids(engine.tokenizer, LongPageEnv.page))
    # long's page fits its own row, but not beside big's (live) row; big's own observation fits.
    assert long_prompt + 2 * NEW + page <= CONTEXT < big_prompt + NEW - 1 + page
    assert big_prompt + 2 * (NEW + ERROR) <= CONTEXT
    return big, long, plain


def test_an_observation_that_does_not_fit_ends_its_episode_with_context(parts):
    engine = _engine(parts, max_steps=2)
    big, long, plain = _long_page_tasks(engine)
    by_id = {t.query_id: t for t in engine.run([("e0", big), ("e1", long), ("e2", plain)])}
    assert by_id["long"].termination == "context" and len(by_id["long"].steps) == 1
    for other in ("big", "plain"):
        assert by_id[other].termination == "step_cap" and len(by_id[other].steps) == 2


def test_a_tree_branch_whose_observation_does_not_fit_is_a_context_leaf(parts):
    engine = _engine(parts, max_steps=2)
    tasks = _long_page_tasks(engine)
    trees = {t.query_id: t for t in tree_schedule.run(engine, [(f"t{i}", t) for i, t in enumerate(tasks)],
                                                      TreeSettings(n=2, f=2, fork_depths=(1,)))}
    long_tree = trees["long"]
    assert len(long_tree.nodes) == 2 and set(long_tree.leaf_terminations.values()) == {"context"}
    for other in ("big", "plain"):
        assert len(trees[other].leaves()) == 2
        assert set(trees[other].leaf_terminations.values()) == {"step_cap"}
