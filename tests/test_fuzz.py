"""The fuzz suite: hostile input for both action parsers, the calculator, every tool of the tool world and
the registry, the judges' reply readers, and the request side of the server.

Per target (see `fuzz_targets.py` for what each accepts): every corpus string (`fuzz_corpus.py`), then
`Target.examples` hypothesis examples, derandomized so that CI runs the same cases every time. A case
fails on an undocumented exception, a broken contract or too much CPU time (1 s for the calculator).
`test_case_count` checks the total (>= 10,000) and prints the counts; FUZZ_SUMMARY=path writes them as
JSON. The long run is `python tests/fuzz_long.py --cases 1000000`.
"""
import collections
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_corpus import CATEGORIES, CORPUS, code_attacks
from fuzz_targets import AUDIT, TARGETS, chat_format, run_case

from steprl_jax.tools.calculator import calculate
from steprl_jax.tools.protocol import INVALID_VALUE, ToolError

# ast.parse warns about inputs such as "1if" on its way to rejecting them.
pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")

CASES: collections.Counter = collections.Counter()
SECONDS: collections.Counter = collections.Counter()
RAN: set = set()


def _case(target, value):
    CASES[target.name] += 1
    return run_case(target, value)


@pytest.mark.parametrize("name", list(TARGETS))
def test_corpus(name):
    target = TARGETS[name]
    target.setup()
    start = time.monotonic()
    failures = [f for text in CORPUS if (f := _case(target, target.from_text(text))) is not None]
    SECONDS["corpus"] += time.monotonic() - start
    RAN.add(("corpus", name))
    assert not failures, "\n".join(f.describe() for f in failures[:5]) + f"\n{len(failures)} failing corpus strings"


@pytest.mark.parametrize("name", list(TARGETS))
def test_generated(name):
    target = TARGETS[name]
    target.setup()

    @settings(max_examples=target.examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def case(value):
        failure = _case(target, value)
        assert failure is None, failure.describe(2000)

    start = time.monotonic()
    case()
    SECONDS["generated"] += time.monotonic() - start
    RAN.add(("generated", name))


def test_calculator_never_evaluates_code(tmp_path):
    canary = tmp_path / "canary"
    for attack in code_attacks(str(canary)):
        with pytest.raises(ToolError) as err:
            AUDIT.run(calculate, attack)
        assert err.value.error_type == INVALID_VALUE and err.value.message, attack
    assert not canary.exists()
    # The watch itself sees code being run (so that its silence above means something).
    _, events = AUDIT.run(lambda: open(canary, "w").close())
    assert "open" in events and canary.exists()
    _, events = AUDIT.run(exec, "1 + 1")
    assert "exec" in events


# Found by fuzzing: JSON nested deeper than the parser goes raised RecursionError (a 500).
def test_serve_parse_tool_calls_deep_json_is_not_a_call():
    text = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert chat_format().parse_tool_calls(text) == (text, [])


def test_serve_tool_call_arguments_deep_json_are_kept_as_written():
    module = chat_format()
    call = {"function": {"name": "f", "arguments": "[" * 100_000}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    (normalized,) = module.normalize_messages([message], inline_tool_calls=True)
    assert "[" * 1000 in json.dumps(normalized)


def test_case_count():
    if RAN != {(kind, name) for kind in ("corpus", "generated") for name in TARGETS}:
        pytest.skip("counts only when every target ran")
    summary = {"cases": sum(CASES.values()), "targets": len(TARGETS), "corpus_strings": len(CORPUS),
               "corpus_categories": {k: len(v) for k, v in CATEGORIES.items()},
               "seconds": {k: round(v, 1) for k, v in SECONDS.items()}, "per_target": dict(CASES)}
    print(json.dumps(summary, indent=1))
    if os.environ.get("FUZZ_SUMMARY"):
        with open(os.environ["FUZZ_SUMMARY"], "w") as f:
            json.dump(summary, f, indent=1)
    assert summary["cases"] >= 10_000
