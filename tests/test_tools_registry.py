import json
import threading
import time

import jsonschema
from hypothesis import given, settings, strategies as st

from steprl_jax.tools.calculator import calculator_tool
from steprl_jax.tools.protocol import Tool, ToolError, object_schema
from steprl_jax.tools.registry import ToolRegistry


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def _registry():
    slow = Tool("slow", "sleeps", object_schema({"seconds": {"type": "number"}}), _slow, timeout_s=0.2)
    broken = Tool("broken", "raises", object_schema({}), lambda: 1 / 0)
    picky = Tool("picky", "rejects", object_schema({}), lambda: (_ for _ in ()).throw(ToolError("not_found", "nope")))
    return ToolRegistry([calculator_tool(), slow, broken, picky])


def test_results_in_call_order_with_typed_errors():
    registry = _registry()
    results = registry.execute([
        {"name": "calculator", "arguments": {"expression": "1+1"}},
        {"name": "missing", "arguments": {}},
        {"name": "calculator", "arguments": {"expression": 5}},
        {"name": "calculator", "arguments": '{"expression": "2*3"}'},
        {"name": "broken", "arguments": {}},
        {"name": "picky", "arguments": {}},
        "not a call",
        {"name": "calculator", "arguments": {"expression": "1", "extra": 1}},
    ])
    assert [r.content if r.ok else r.error_type for r in results] == [
        "2", "unknown_tool", "malformed_arguments", "6", "tool_failure", "not_found", "malformed_arguments",
        "malformed_arguments"]
    assert "expression" in results[2].message and "calculator" in results[1].message


def test_timeout_is_an_error_and_calls_run_concurrently():
    registry = _registry()
    results = registry.execute([{"name": "slow", "arguments": {"seconds": 5}},
                                {"name": "slow", "arguments": {"seconds": 0.01}}])
    assert results[0].error_type == "timeout" and results[1].content == "done"
    # Concurrency, checked without timing: two calls each waiting for the other finish only if run together.
    barrier = threading.Barrier(2, timeout=2)
    meet = Tool("meet", "waits for a partner", object_schema({}), lambda: barrier.wait() >= 0)
    both = ToolRegistry([meet]).execute([{"name": "meet", "arguments": {}}] * 2)
    assert all(r.ok and r.content is True for r in both)


def test_openai_schema_shape():
    schema = calculator_tool().openai_schema
    assert schema["type"] == "function" and set(schema["function"]) == {"name", "description", "parameters"}
    jsonschema.Draft202012Validator.check_schema(schema["function"]["parameters"])


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.lists(_json | st.fixed_dictionaries({"name": st.sampled_from(["calculator", "broken", "x"]),
                                                "arguments": _json}), max_size=4))
def test_fuzz_registry_never_raises(calls):
    results = _registry().execute(calls)
    assert len(results) == len(calls)
    for r in results:
        json.dumps(r.to_json())
