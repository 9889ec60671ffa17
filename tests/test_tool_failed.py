"""One definition of "a tool failed" (METHODS 2.2: unable_to_answer marks a reasonable trajectory
defeated by the tools): a result whose error type is `tool_failure`. The agent's own mistakes, a
schema error or an unknown tool, do not count. The tool-world outcome rule and the trajectory
judge's item agree on it."""
import pytest

from configs import demo
from steprl_jax.agents.records import Step, Trajectory
from steprl_jax.agents.tasks import build_suite
from steprl_jax.judges.items import tool_failed, trajectory_item
from steprl_jax.tools.protocol import Tool, object_schema
from steprl_jax.tools.registry import ToolRegistry


def _service_down(city):
    raise RuntimeError("weather service unavailable")


@pytest.fixture(scope="module")
def results():
    """Real results of a weather tool whose service is down: keyed by what went wrong."""
    registry = ToolRegistry([Tool("weather", "today's weather in a city", object_schema({"city": {"type": "string"}}),
                                  _service_down)])
    calls = {"schema_error": {"name": "weather", "arguments": {"city": 3}},
             "unknown_tool": {"name": "forecast", "arguments": {"city": "Rome"}},
             "tool_failure": {"name": "weather", "arguments": {"city": "Rome"}}}
    out = dict(zip(calls, (r.to_json() for r in registry.execute(list(calls.values())))))
    registry.close()
    assert {kind: r["error"]["type"] for kind, r in out.items()} == {
        "schema_error": "malformed_arguments", "unknown_tool": "unknown_tool", "tool_failure": "tool_failure"}
    return out


def _trajectory(tool_results):
    steps = [Step("<tool_call>[...]</tool_call>", [], [], tool_results=[r]) for r in tool_results]
    steps.append(Step("<tool_call>[response_gen]</tool_call>", [], []))
    return Trajectory(id="t", query_id="q", question="weather in Rome?", prompt_text="", prompt_ids=[], steps=steps,
                      reference_answer="sunny, 23°C", final_answer="Sorry, I cannot get the weather right now.")


@pytest.mark.parametrize("kinds,failed", [
    ((), False),
    (("schema_error",), False),
    (("schema_error", "unknown_tool"), False),
    (("tool_failure",), True),
    (("schema_error", "tool_failure"), True),
])
def test_only_a_tool_failure_makes_a_trajectory_tool_failed(results, kinds, failed):
    trajectory = _trajectory([results[k] for k in kinds])
    assert tool_failed(trajectory) is failed
    assert tool_failed(trajectory.steps) is failed
    assert trajectory_item(trajectory).tool_failed is failed


def test_the_toolworld_outcome_rule_uses_the_same_definition(results):
    config = demo.get_config()
    config.task.name, config.task.num_tasks = "toolworld", 1
    config.env.tools = ()  # every tool of the world (the demo's calculator is not one of them)
    suite = build_suite(config)
    task = suite.tasks[0]
    declined_after = lambda kinds: suite.outcome_rule(task, _trajectory([results[k] for k in kinds]))
    assert declined_after(("schema_error",)) == "false"
    assert declined_after(("unknown_tool",)) == "false"
    assert declined_after(("tool_failure",)) == "unable_to_answer"
