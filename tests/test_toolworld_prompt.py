"""The tool world's prompt: compact tool rendering, a context that holds a 6-step episode."""
import dataclasses
import json

import pytest

from configs import portool_toolworld
from models_real import smollm2, smollm2_tokenizer
from steprl_jax.algorithms.sft import expert_rows
from steprl_jax.tools import formats
from steprl_jax.agents.environments import TOOL_CALL_SYSTEM_PROMPT, Task, ToolCallEnv, clip_result
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.agents.tasks import build_suite, toolworld_queries
from steprl_jax.data.toolworld import execute_plan, toolworld_demonstration
from steprl_jax.models.chat import compact_tool_line, render_tools
from steprl_jax.tools.world.generate import generate_world
from steprl_jax.tools.world.queries import make_splits
from steprl_jax.tools.protocol import UNKNOWN_TOOL, ToolCall
from steprl_jax.tools.registry import ToolRegistry
from steprl_jax.tools.world.tools import make_registry
from steprl_jax.training.pack import pack

CALL_SYNTAX = '<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def schemas():
    world = generate_world(0)
    query = make_splits(0, 4, 4)["train"][0]
    registry = make_registry(world, query.context)
    try:
        return registry.openai_schemas()
    finally:
        registry.close()


def toolworld_config(**env):
    config = portool_toolworld.get_config()
    config.task.num_tasks = 4
    for key, value in env.items():
        config.env[key] = value
    return config


class _NoSampler:
    max_context = 1 << 20


def prompt_ids(config, tokenizer):
    suite = build_suite(config)
    return prompt_ids_of(suite.env, tokenizer, suite.tasks)


def prompt_ids_of(env, tokenizer, tasks):
    """(text, ids) of each task's prompt, as `RolloutEngine.prompt` renders it."""
    engine = RolloutEngine(_NoSampler(), tokenizer, env, RolloutConfig())
    try:
        return [engine.prompt(task) for task in tasks]
    finally:
        engine.close()
        for task in tasks:
            env.release(task)


# ------------------------------------------------------------------ part 1: compact rendering
def test_compact_line_keeps_required_optional_enums_and_descriptions():
    tool = {"type": "function", "function": {
        "name": "distance", "description": "  Distance between two cities. ",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["b", "a"],
                       "properties": {"a": {"type": "string", "minLength": 1, "description": "a city"},
                                      "unit": {"type": "string", "enum": ["km", "mi"]},
                                      "b": {"type": "string", "pattern": "^x$"},
                                      "v": {"type": ["string", "null"]},
                                      "xs": {"type": "array", "items": {"type": "integer"}}}}}}
    assert compact_tool_line(tool) == ('distance(b: string, a: string (a city), unit?: "km"|"mi", '
                                       'v?: string|null, xs?: array of integer) - Distance between two cities.')
    bare = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    assert compact_tool_line(bare) == "now()"


def test_compact_rendering_of_the_tool_world(schemas):
    text = render_tools(schemas, "compact")
    lines = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert len(lines) == len(schemas) == 23  # 22 tools and response_gen
    for line, schema in zip(lines, schemas):
        function = schema["function"]
        assert line.startswith(function["name"] + "(") and line.endswith(" - " + function["description"])
        parameters = function["parameters"]
        for name, prop in parameters["properties"].items():
            optional = "" if name in parameters["required"] else "?"
            assert f"{name}{optional}: " in line
            for value in prop.get("enum", ()):
                assert json.dumps(value) in line
    for boilerplate in ("additionalProperties", "minLength", "pattern", '"type"', '"properties"'):
        assert boilerplate not in text
    assert CALL_SYNTAX in text and '"arguments"' in text
    with pytest.raises(ValueError, match="tool rendering"):
        render_tools(schemas, "yaml")


def test_env_renderings(schemas):
    world = generate_world(0)
    query = make_splits(0, 4, 4)["train"][0]
    registry = make_registry(world, query.context)
    task = Task("t", "Which country is Sydney in?")
    try:
        json_env = ToolCallEnv(registry)
        assert json_env.messages(task)[0]["content"] == TOOL_CALL_SYSTEM_PROMPT
        assert json_env.tool_schemas(task) == schemas
        compact = ToolCallEnv(registry, tool_rendering="compact")
        system = compact.messages(task)[0]["content"]
        assert system == TOOL_CALL_SYSTEM_PROMPT + "\n\n" + render_tools(schemas, "compact")
        assert compact.tool_schemas(task) is None
        with pytest.raises(ValueError, match="tool_rendering"):
            ToolCallEnv(ToolRegistry(), tool_rendering="yaml")
    finally:
        registry.close()


def test_prompt_tokens_before_and_after(tokenizer):
    """The report's prompt (JSON schemas and 2 demonstrations) against the compact one."""
    before = prompt_ids(toolworld_config(tool_rendering="json", few_shot=2), tokenizer)
    after = prompt_ids(toolworld_config(), tokenizer)
    longest_before = max(len(ids) for _, ids in before)
    longest_after = max(len(ids) for _, ids in after)
    assert longest_before > 3800  # the reported ~3,900 of 4,096
    assert longest_after < 1500
    for text, ids in after:
        assert CALL_SYNTAX in text and '"additionalProperties"' not in text
        assert "<tool_response>" not in text.split("</tools>")[1]  # no demonstrations
        assert text.endswith("<|im_start|>assistant\n")



SUBSET = ("get_weather", "calculate", "response_gen")


def test_a_subset_of_the_tools_is_what_the_prompt_lists_and_the_demonstrations_call(tokenizer):
    """env.tools: each episode offers those tools only (a shorter prompt); a query whose plan needs
    another has no expert row; a call to a tool left out is an error observation."""
    full = prompt_ids(toolworld_config(), tokenizer)
    config = toolworld_config(tools=SUBSET)
    config.task.num_tasks = 64
    suite = build_suite(config, split="train")
    (text, ids), = prompt_ids_of(suite.env, tokenizer, suite.tasks[:1])
    tools_part = text.split("</tools>")[0]
    assert all(f"{name}(" in tools_part for name in SUBSET) and "search_flights(" not in tools_part
    assert len(ids) < min(len(i) for _, i in full) - 1000  # 3 tools listed instead of 23
    world, queries = toolworld_queries(config, "train")
    servable = [q for q in queries if all(c.name in SUBSET for step in q.plan for c in step)]
    rows = expert_rows(config, tokenizer)
    assert 0 < len(rows) == len(servable) < len(queries)
    for row in rows:
        for segment in row.prefix[1:]:
            if segment.loss:
                names = {call["name"] for call in json.loads(
                    tokenizer.decode(segment.ids).split("<tool_call>")[1].split("</tool_call>")[0])}
                assert names <= set(SUBSET), names
    registry = suite.env.registry_for(suite.tasks[0])
    try:
        result = registry.execute_one(ToolCall("search_flights", {"origin": "LHR", "destination": "JFK"}))
    finally:
        suite.env.release(suite.tasks[0])
    assert not result.ok and result.error_type == UNKNOWN_TOOL and "get_weather" in result.message


@pytest.mark.parametrize("tools, message", [
    (("get_weather", "teleport", "response_gen"), "['teleport'] are not tool-world tools"),
    (("get_weather",), "answers through 'response_gen'"),
])
def test_a_bad_tool_subset_names_the_field(tools, message):
    with pytest.raises(Exception, match="config.env.tools") as err:
        build_suite(toolworld_config(tools=tools))
    assert message in str(err.value)


# ------------------------------------------------------------------ part 2: a 6-step episode fits
def rollout_view(env, tokenizer, task, world, query):
    """(prompt ids, [(action ids, observation ids)]) of the query's reference plan, as a rollout
    of `env` sees it: the engine's prompt, each action encoded, each observation as appended."""
    [(_, prompt)] = prompt_ids_of(env, tokenizer, [task])
    steps = []
    for demo_step, results in zip(toolworld_demonstration(world, query).steps, _plan_results(world, query)):
        observation = formats.render_tool_responses([clip_result(r) for r in results]) if results else ""
        steps.append((tokenizer.encode(demo_step.action, add_special_tokens=False),
                      env.observation_ids(tokenizer, observation)))
    return prompt, steps


def _plan_results(world, query):
    return execute_plan(world, query) + [[]]  # the final response_gen step has no observation


def padded(query, steps: int):
    """The query with its tool steps repeated (in order) to `steps` steps, response_gen last."""
    tools = query.plan[:-1]
    plan = tuple(tools[i % len(tools)] for i in range(steps - 1)) + (query.plan[-1],)
    return dataclasses.replace(query, plan=plan)


def test_default_config_fits_a_six_step_episode(tokenizer):
    config = portool_toolworld.get_config()
    assert (config.env.few_shot, config.env.tool_rendering) == (0, "compact")
    assert (config.rollout.max_steps, config.rollout.max_context) == (6, 8192)
    max_new = int(config.rollout.max_new_tokens)
    config.task.num_tasks = 256  # every train template
    suite = build_suite(config, split="train")
    world, train = toolworld_queries(config, "train")
    queries = {q.id: q for q in train}
    tasks = {t.id: t for t in suite.tasks}
    assert set(tasks) == set(queries) and len(queries) == 256
    views = {}
    for qid, query in queries.items():
        _, steps = rollout_view(suite.env, tokenizer, tasks[qid], world, query)
        views[qid] = sum(len(a) + len(o) for a, o in steps)
        assert max(len(a) for a, _ in steps) <= max_new, query.template  # every expert action can be generated
    longest_plan = max(len(q.plan) for q in queries.values())
    chosen = [max((q for q in queries.values() if len(q.plan) == longest_plan), key=lambda q: views[q.id]),
              max(queries.values(), key=lambda q: views[q.id])]  # the longest plan, the most tokens
    for query in chosen:
        six = padded(query, config.rollout.max_steps) if len(query.plan) < config.rollout.max_steps else query
        prompt, steps = rollout_view(suite.env, tokenizer, tasks[query.id], world, six)
        assert len(steps) == 6
        # Room for max_new_tokens at every step, each observation as appended.
        budget = len(prompt) + 6 * max_new + sum(len(o) for _, o in steps)
        assert budget <= config.rollout.max_context, (query.template, budget)
        # And the engine's own check (`RolloutEngine._settle`) lets the 6th step be generated.
        length = len(prompt)
        for action, observation in steps[:-1]:
            length += len(action)
            assert length + len(observation) + max_new <= config.rollout.max_context
            length += len(observation)


# ------------------------------------------------------------------ part 3: expert rows for SFT
@pytest.mark.parametrize("rendering", ["compact", "json"])
def test_expert_rows_are_what_a_rollout_sees(tokenizer, rendering):
    config = toolworld_config(tool_rendering=rendering)
    config.task.num_tasks = 8
    rows = expert_rows(config, tokenizer)
    suite = build_suite(config, split="train")
    world, queries = toolworld_queries(config, "train")
    assert len(rows) == len(suite.tasks) == len(queries) == 8
    assert [t.id for t in suite.tasks] == [q.id for q in queries]
    for row, task, query in zip(rows, suite.tasks, queries):
        prompt, steps = rollout_view(suite.env, tokenizer, task, world, query)
        assert not row.branches
        assert list(row.prefix[0].ids) == prompt and not row.prefix[0].loss
        # action (loss), observation (no loss), ..., the response_gen action (loss) last.
        expected = [(ids, loss) for action, observation in steps
                    for ids, loss in ((action, True), (observation, False)) if ids]
        assert [(list(s.ids), s.loss) for s in row.prefix[1:]] == expected
        actions = [step.action for step in toolworld_demonstration(world, query).steps]
        assert [tokenizer.decode(s.ids) for s in row.prefix if s.loss] == actions
        assert row.prefix[-1].loss and actions[-1].endswith("</tool_call>")
        assert '"name": "response_gen"' in actions[-1]
    batch = pack(rows)
    assert batch.tokens.shape[0] == len(rows)
    assert int(batch.loss_mask.sum()) == sum(len(s.ids) for row in rows for s in row.prefix if s.loss)
    for r, row in enumerate(rows):
        ids = [t for s in row.prefix for t in s.ids]
        assert batch.tokens[r, :len(ids)].tolist() == ids


def test_expert_rows_of_the_tag_format_are_the_gold_steps(tokenizer):
    from configs import demo

    config = demo.get_config()
    config.task.num_tasks = 3
    suite = build_suite(config, split="train")
    rows = expert_rows(config, tokenizer)
    assert len(rows) == 3
    for row, task in zip(rows, suite.tasks):
        actions = [step.action for step in suite.demonstrate(task).steps]
        assert [tokenizer.decode(s.ids) for s in row.prefix if s.loss] == actions
        assert actions[-1].endswith("</answer>") and not row.prefix[-1].ids[-1] == tokenizer.eos_token_id


def test_smollm2_next_token_loss_on_an_expert_row():
    import jax.numpy as jnp
    import numpy as np

    from steprl_jax.training.forward import sequence_logprobs

    model, tokenizer = smollm2()
    config = toolworld_config()
    config.task.num_tasks = 4
    row = min(expert_rows(config, tokenizer), key=len)
    batch = pack([row])
    logp_bt = sequence_logprobs(model, jnp.asarray(batch.tokens), attention_mask_bt=jnp.asarray(batch.attention_mask),
                                loss_mask_bt=jnp.asarray(batch.loss_mask))
    mask = np.asarray(batch.loss_mask)
    nll = -float((np.asarray(logp_bt) * mask).sum() / mask.sum())
    assert np.isfinite(nll) and 0.0 < nll < np.log(model.config.vocab_size), nll
