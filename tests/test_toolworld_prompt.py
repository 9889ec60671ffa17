"""The tool world's prompt: compact tool rendering, a context that holds a 6-step episode."""
import dataclasses
import json

import pytest

from configs import portool_toolworld
from models_real import smollm2_tokenizer
from steprl_jax.agents import formats
from steprl_jax.agents.environments import TOOL_CALL_SYSTEM_PROMPT, ToolCallEnv, clip_result
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.agents.tasks import build_suite
from steprl_jax.data.toolworld import toolworld_demonstration
from steprl_jax.models.chat import compact_tool_line, render_tools
from steprl_jax.tools.world.generate import generate_world
from steprl_jax.tools.world.queries import make_splits
from steprl_jax.tools.world.tools import make_registry

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
    from steprl_jax.agents.environments import Task
    from steprl_jax.tools.registry import ToolRegistry

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
    from steprl_jax.data.toolworld import execute_plan

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
    world = generate_world(int(config.task.world_seed))
    queries = {q.id: q for q in make_splits(int(config.task.world_seed), 256, 256, seed=int(config.seed))["train"]}
    tasks = {t.id: t for t in suite.tasks}
    assert set(tasks) == set(queries)
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
