"""Fuzz targets: what each parser, tool and reader is fed, and what counts as an acceptable answer.

Shared by the CI test (`test_fuzz.py`, through hypothesis) and the long run (`fuzz_long.py`, through a
seeded `random.Random`): every target has one generator written against `Source`, which either backend
implements, so both runs draw from the same distribution and CI failures shrink.

A `Target` has
* `generate(source)`: one input; a quarter of them are `from_text` of a corpus string, mutated or not;
* `from_text(text)`: a corpus string as this target's input (deterministic);
* `check(value)`: runs the code under test and raises `Unexpected` when the answer breaks the contract
  written in its docstring.

`run_case(target, value)` turns everything else into a `Failure`: any exception the target does not
document (TypeError, KeyError, RecursionError, OverflowError, MemoryError, StopIteration, a raw
ValueError where a typed error is documented, ...), a broken contract, more than `cpu_limit_s` of CPU
time on the calling thread (CPU time, not wall time, so that a loaded machine does not fail it), or no
answer within `WALL_LIMIT_S` (an alarm interrupts the case).

Adding a target is one line in `TARGETS` (plus its check and generator).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import math
import random
import re
import signal
import sys
import threading
import time
import contextlib
import traceback
from fractions import Fraction
from typing import Any, Callable, Sequence

from fuzz_corpus import CORPUS, FRAGMENTS, VALID, code_attacks

from steprl_jax.judges import rules
from steprl_jax.judges.http_backend import _read_choices, _Retryable
from steprl_jax.judges.verdicts import (
    FAILED_TIE, FAILED_UNPARSED, OUTCOME_LABELS, OUTCOME_REWARDS, PROCESS_LABELS, PROCESS_REWARDS,
    TRAJECTORY_LABELS, TRAJECTORY_REWARDS, Verdict, majority, parse_label)
from steprl_jax.agents.code_env import CODE_BLOCK_STOP
from steprl_jax.sampling.stop import first_stop, stop_automaton
from steprl_jax.tools import code_format, code_turns
from steprl_jax.tools.calculator import calculate, calculator_tool
from steprl_jax.tools.code_format import CodeAction, parse_code_action
from steprl_jax.tools.code_turns import Turn, parse_turn
from steprl_jax.tools.formats import (
    ACTION_TAGS, DEFAULT_FORMAT_CAP, FORMAT_CHECKS, STEP_PROBLEMS, TAG_PROBLEMS, ToolCallStep, TaggedAction,
    formatting_checks, formatting_reward, parse_tagged_action, parse_tool_call_step, render_tagged_action, render_tool_responses)
from steprl_jax.tools.protocol import (
    ERROR_TYPES, INVALID_VALUE, MALFORMED_ARGUMENTS, NOT_FOUND, TIMEOUT, TOOL_FAILURE, UNKNOWN_TOOL, ToolCall,
    ToolError, ToolResult)
from steprl_jax.tools.world.generate import NEWS_TOPICS, EpisodeContext, generate_world
from steprl_jax.tools.world.tools import entity_facts, make_registry, make_tools


class Unexpected(AssertionError):
    """An answer that breaks the target's contract."""


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise Unexpected(message)


# ------------------------------------------------------------------ sources: hypothesis or a seeded Random
class Source:
    """The primitive draws a generator makes; everything else is built from them."""

    def pick(self, options: Sequence) -> Any: ...
    def integer(self, low: int, high: int) -> int: ...
    def text(self, max_size: int) -> str: ...
    def real(self) -> float: ...

    def chance(self, percent: int) -> bool:
        return self.integer(0, 99) < percent


class HypothesisSource(Source):
    def __init__(self, draw):
        from hypothesis import strategies as st
        self.draw, self.st = draw, st

    def pick(self, options):
        return self.draw(self.st.sampled_from(options))

    def integer(self, low, high):
        return self.draw(self.st.integers(low, high))

    def text(self, max_size):
        return self.draw(self.st.text(max_size=max_size))

    def real(self):
        return self.draw(self.st.floats())


# Code point ranges the random source writes text from: ASCII first, then controls, Latin, any BMP
# character (look-alikes, combining marks, right-to-left), astral planes and lone surrogates.
_RANGES = ((0x20, 0x7E),) * 12 + ((0x00, 0x1F), (0x7F, 0x2FF), (0x300, 0x36F), (0x370, 0x52F), (0x2000, 0x206F),
                                 (0xFF00, 0xFFEF), (0x80, 0xFFFF), (0x10000, 0x10FFFF), (0xD800, 0xDFFF))


class RandomSource(Source):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, options):
        return options[self.rng.randrange(len(options))]

    def integer(self, low, high):
        return self.rng.randint(low, high)

    def text(self, max_size):
        size = min(max_size, int(self.rng.expovariate(1 / 12)))
        ranges = [self.rng.choice(_RANGES) for _ in range(2)]
        return "".join(chr(self.rng.randint(*self.rng.choice(ranges))) for _ in range(size))

    def real(self):
        if self.rng.random() < 0.3:
            return self.rng.choice((0.0, -0.0, math.nan, math.inf, -math.inf, 5e-324, 1.7976931348623157e308))
        return self.rng.uniform(-1, 1) * 10.0 ** self.rng.randint(-320, 308)


# ------------------------------------------------------------------ generic generators
def mutate(src: Source, text: str) -> str:
    """One to three edits: cut, insert a fragment, delete, repeat a span (nesting), splice another
    corpus string, overwrite with random text, change case, or repeat a fragment."""
    for _ in range(src.integer(1, 3)):
        op, n = src.integer(0, 8), len(text)
        i = src.integer(0, n)
        j = min(n, i + src.integer(0, 64))
        if op == 0:
            text = text[:i]
        elif op == 1:
            text = text[i:]
        elif op == 2:
            text = text[:i] + src.pick(FRAGMENTS) + text[i:]
        elif op == 3:
            text = text[:i] + text[j:]
        elif op == 4:
            text = text[:i] + text[i:j] * src.integer(2, 200) + text[j:]
        elif op == 5:
            text = text[:i] + src.pick(CORPUS) + text[i:]
        elif op == 6:
            text = text[:i] + src.text(8) + text[j:]
        elif op == 7:
            text = src.pick((str.upper, str.lower, str.swapcase, str.casefold))(text)
        else:
            text = text[:i] + src.pick(FRAGMENTS) * src.integer(1, 2000) + text[i:]
    return text


def fragment_soup(src: Source) -> str:
    return "".join(src.pick(FRAGMENTS) if src.chance(70) else src.text(4) for _ in range(src.integer(0, 12)))


def adversarial_text(src: Source) -> str:
    k = src.integer(0, 5)
    if k == 0:
        return src.pick(CORPUS)
    if k == 1:
        return mutate(src, src.pick(CORPUS))
    if k == 2:
        return mutate(src, src.pick(VALID))
    if k == 3:
        return src.text(64)
    if k == 4:
        return fragment_soup(src)
    return mutate(src, fragment_soup(src))


def small_text(src: Source) -> str:
    k = src.integer(0, 3)
    return src.text(16) if k == 0 else src.pick(FRAGMENTS) if k == 1 else src.pick(_WORDS) if k == 2 else ""


_WORDS = ("Paris", "the answer", "42", "3.5", "-7", "GOOD", "unable to answer", "x", " ", "\n", "None")
_SPECIAL_NUMBERS = (0, -0.0, 1, -1, 0.5, 2.0, 1e308, -1e308, 1.7976931348623157e308, 5e-324, math.nan, math.inf,
                    -math.inf, 2**53 + 1, 2**63, 10**400, -10**400, 10**4000, True, False)


def number(src: Source) -> Any:
    k = src.integer(0, 3)
    return (src.pick(_SPECIAL_NUMBERS) if k == 0 else src.real() if k == 1
            else src.integer(-10**6, 10**6) if k == 2 else src.integer(-10**30, 10**30) / src.pick((1, 7, 1000)))


def integer_edge(src: Source) -> Any:
    if src.chance(50):
        return src.integer(-100, 100)
    return src.pick((0, 1, -1, 2.0, 1.5, 36600, 36601, -36601, 10**30, -10**30, 2**63, 10**400, 1e300, True, None))


def json_value(src: Source, depth: int = 0) -> Any:
    """A JSON value (as json.loads gives, NaN and infinities included), at most 4 levels deep."""
    k = src.integer(0, 9 if depth < 3 else 5)
    if k == 0:
        return None
    if k == 1:
        return src.chance(50)
    if k == 2:
        return number(src)
    if k == 3:
        return src.integer(-1000, 1000)
    if k <= 5:
        return small_text(src) if src.chance(70) else adversarial_text(src)
    if k <= 7:
        return [json_value(src, depth + 1) for _ in range(src.integer(0, 4))]
    return {small_text(src): json_value(src, depth + 1) for _ in range(src.integer(0, 4))}


def loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


# ------------------------------------------------------------------ the tool world every tool target uses
WORLD = generate_world(7)
CONTEXT = EpisodeContext(next(iter(WORLD.cities)), dt.datetime.combine(WORLD.today, dt.time(12)))
TOOLS = {tool.name: tool for tool in make_tools(WORLD, CONTEXT)}  # no injected failures: none may fail
REGISTRY = make_registry(WORLD, CONTEXT, failure_rate=0.3, salt="fuzz")  # injected failures, typed
SERVICE_DOWN = "service is temporarily unavailable"
ECHO_TOOLS = frozenset({"filter_list", "sort_list", "response_gen"})  # return (parts of) their arguments

_FACTS = entity_facts(WORLD)
_DAYS = [WORLD.first_day + dt.timedelta(days=d) for d in range((WORLD.last_day - WORLD.first_day).days + 1)]
_DATES = tuple(d.isoformat() for d in _DAYS) + (
    "0001-01-01", "9999-12-31", "2024-02-29", "2023-02-29", "2024-13-01", "2024-00-10", "2024-1-1", "20240101",
    "2024-01-01T00:00", "٢٠٢٤-٠١-٠١", "２０２４-０１-０１", "2024-01-01\n", "", "0000-00-00")
_TIMES = ("00:00", "12:30", "23:59", "24:00", "23:60", "7:5", "")
POOLS: dict[str, tuple] = {
    **dict.fromkeys(("city", "origin", "destination", "from_city", "to_city"), tuple(WORLD.cities) + (
        "paris", " Tokyo ", "TOKYO", "Atlantis", "")),
    **dict.fromkeys(("date", "start_date", "end_date"), _DATES),
    "datetime": tuple(f"{d}T{t}" for d in _DATES[::7] for t in _TIMES) + (
        "9999-12-31T23:59", "0001-01-01T00:00", "2024-01-01 10:00", "2024-01-01T10:00:00"),
    "league": tuple(WORLD.leagues) + tuple(WORLD.leagues.values()) + ("NBA", ""),
    "ticker": tuple(c.ticker for c in WORLD.companies.values()) + ("ZZZZ", "acme", "ß"),
    "flight_number": tuple(WORLD.flights) + ("XX9999", "ab1", "AB12\n"),
    "entity": tuple(_FACTS) + ("Nowhere Inc",),
    "attribute": tuple(sorted({a for facts in _FACTS.values() for a in facts})) + ("height", "__class__"),
    **dict.fromkeys(("from_currency", "to_currency"), tuple(WORLD.exchange_rates) + ("usd", "XXX", "EURO")),
    "topic": tuple(NEWS_TOPICS) + ("Sports", "weather"),
    "field": ("value", "name", "price", "x", "", "__dict__"),
    "answer": _WORDS,
}


def items(src: Source) -> list:
    fields = ("value", "name", "price")
    k = src.integer(0, 3)
    if k == 0:
        return [json_value(src, 2) for _ in range(src.integer(0, 8))]
    if k == 1:
        return [number(src) for _ in range(src.integer(0, 8))]
    if k == 2:
        return [{src.pick(fields): json_value(src, 3) for _ in range(src.integer(0, 3))}
                for _ in range(src.integer(0, 8))]
    return [src.integer(-5, 5)] * src.integer(0, 1100)  # past maxItems


_NUMBER_LITERALS = ("0", "1", "2", "7", "10", "0.1", ".5", "5.", "1e3", "1e-3", "1E1000", "1e1001", "9" * 100,
                    "9" * 101, "1_000", "0x1F", "0b11", "007", "3.14159", "1e99999999", "2**3400", "3**2144", "nan")
_FUNCTIONS = ("sqrt", "abs", "round", "floor", "ceil", "min", "max", "factorial", "log", "exp", "pow", "eval",
              "__import__", "open", "sin")
_OPERATORS = ("+", "-", "*", "/", "//", "%", "**", "^", "×", "÷", "−", " ", ",", "@", "<<", " and ", " if ", ".")
_CODE = tuple(code_attacks("fuzz_canary_never_created"))


def expression(src: Source, depth: int = 0) -> str:
    k = src.integer(0, 8) if depth < 6 else 0
    if k <= 1:
        j = src.integer(0, 2)
        return src.pick(_NUMBER_LITERALS) if j == 0 else str(src.integer(-10**6, 10**6)) if j == 1 else repr(src.real())
    if k <= 3:
        return expression(src, depth + 1) + src.pick(_OPERATORS) + expression(src, depth + 1)
    if k == 4:
        return src.pick(("-", "+", "--", "not ", "~")) + expression(src, depth + 1)
    if k == 5:
        return "(" + expression(src, depth + 1) + ")"
    if k == 6:
        arguments = ", ".join(expression(src, depth + 1) for _ in range(src.integer(0, 3)))
        return f"{src.pick(_FUNCTIONS)}({arguments})"
    if k == 7:
        return src.pick(_CODE)
    return mutate(src, expression(src, depth + 1))


_SPECIAL_VALUES: dict[str, Callable[[Source], Any]] = {
    "expression": expression, "items": items, "amount": number, "days": integer_edge, "limit": integer_edge,
    "descending": lambda src: src.chance(50), "value": lambda src: number(src) if src.chance(50) else small_text(src),
}


def schema_value(src: Source, name: str, schema: dict) -> Any:
    """Mostly a plausible value for the argument `name` (the world's own cities, dates, tickers, ...)."""
    k = src.integer(0, 9)
    if k == 0:
        return json_value(src)
    if k == 1:
        return adversarial_text(src)
    if "enum" in schema and k <= 5:
        return src.pick(schema["enum"])
    if name in _SPECIAL_VALUES:
        return _SPECIAL_VALUES[name](src)
    if name in POOLS:
        value = src.pick(POOLS[name])
        return mutate(src, value) if k == 9 else value
    return small_text(src)


def tool_arguments(src: Source, name: str) -> Any:
    if src.chance(4):
        return json_value(src)  # not an object
    parameters = TOOLS[name].parameters
    arguments = {key: schema_value(src, key, schema) for key, schema in parameters["properties"].items()
                 if (key in parameters["required"] and src.chance(95)) or src.chance(50)}
    if src.chance(5):
        arguments[small_text(src)] = json_value(src)
    return arguments


def raw_call(src: Source) -> Any:
    """What an agent may hand the registry: a dict, a ToolCall, arguments as a JSON string, or junk."""
    k = src.integer(0, 9)
    if k == 0:
        return json_value(src)
    known = src.chance(85)
    name = src.pick(tuple(TOOLS)) if known else small_text(src)
    arguments = tool_arguments(src, name) if known else json_value(src)
    if k == 1:
        arguments = json.dumps(arguments) if src.chance(70) else adversarial_text(src)
    if k == 2:
        return ToolCall(name, arguments)
    if k == 3:
        return {"name": name}
    if k == 4:
        return {"name": json_value(src), "arguments": arguments}
    return {"name": name, "arguments": arguments}


# ------------------------------------------------------------------ the targets
@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    check: Callable[[Any], None]
    generator: Callable[[Source], Any]
    from_text: Callable[[str], Any]
    examples: int  # hypothesis examples in CI
    weight: int = 4  # share of the long run
    cpu_limit_s: float = 2.0
    setup: Callable[[], Any] = lambda: None  # one-off work (imports, tokenizers) kept out of the timed cases

    def generate(self, src: Source) -> Any:
        if src.chance(25):
            return self.from_text(adversarial_text(src))
        return self.generator(src)

    def strategy(self):
        from hypothesis import strategies as st
        return st.composite(lambda draw: self.generate(HypothesisSource(draw)))()


@dataclasses.dataclass(frozen=True)
class Failure:
    target: str
    kind: str  # "exception" | "contract" | "slow" | "hang" (| "generator" | "crash" in the long run)
    detail: str
    value: Any

    def describe(self, limit: int = 400) -> str:
        shown = repr(self.value)
        if len(shown) > limit:
            shown = f"{shown[:limit]}... ({len(shown)} characters)"
        return f"[{self.target}] {self.kind}: {self.detail}\n    input: {shown}"


WALL_LIMIT_S = 30.0  # a hang guard, generous for a loaded machine; the time limit proper is CPU time


class _Hang(BaseException):
    """Raised by the alarm into a case that has run too long (a BaseException: no `except Exception`
    in the code under test can take it for an ordinary error)."""


@contextlib.contextmanager
def _wall_limit(seconds: float):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield  # signals reach the main thread only; the long run's parent process still watches
        return

    def alarm(signum, frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(target: Target, value: Any) -> Failure | None:
    start = time.thread_time()
    try:
        with _wall_limit(WALL_LIMIT_S):
            target.check(value)
    except _Hang:
        return Failure(target.name, "hang", f"no answer after {WALL_LIMIT_S:g} s (wall clock)", value)
    except Unexpected as error:
        return Failure(target.name, "contract", str(error)[:1000], value)
    except Exception as error:  # also RecursionError, StopIteration; MemoryError is an Exception too
        where = traceback.extract_tb(error.__traceback__)[-1]
        detail = f"{type(error).__name__}: {str(error)[:300]} (at {where.name}, line {where.lineno})"
        return Failure(target.name, "exception", detail, value)
    spent = time.thread_time() - start
    if spent > target.cpu_limit_s:
        return Failure(target.name, "slow", f"{spent:.2f} s of CPU time (limit {target.cpu_limit_s:g} s)", value)
    return None


# --- tools.formats: SWiRL tags
def check_tagged_action(text: str) -> None:
    """A TaggedAction with a known kind and known problems; a clean action renders and parses back."""
    action = parse_tagged_action(text)
    expect(isinstance(action, TaggedAction), f"returned {type(action).__name__}")
    expect(action.kind in (None, *ACTION_TAGS), f"kind {action.kind!r}")
    expect(set(action.problems) <= set(TAG_PROBLEMS), f"problems {action.problems}")
    expect(action.kind is None or isinstance(action.content, str), "an action without content")
    if action.ok:
        again = parse_tagged_action(render_tagged_action(action.kind, action.content))
        expect(again.ok and (again.kind, again.content) == (action.kind, action.content),
               f"render/parse round trip changed {action} into {again}")


def tagged_text(src: Source) -> str:
    pieces = [small_text(src)]
    for _ in range(src.integer(0, 3)):
        tag = src.pick(("search_query", "math_exp", "answer", "think", "tool_call"))
        body = small_text(src) if src.chance(70) else expression(src)
        pieces.append(src.pick((f"<{tag}>{body}</{tag}>", f"<{tag}>{body}", f"{body}</{tag}>",
                                f"<{tag}>{body}<{tag}>")))
        pieces.append(small_text(src))
    text = "".join(pieces)
    return mutate(src, text) if src.chance(30) else text


# --- tools.code_format: ToRL's python blocks
def check_code_action(text: str) -> None:
    """A CodeAction: stopped exactly when the stop string is there; code only before a stop; the
    answer's braces balance; the shown output is at most 128 + 3 + 128 characters."""
    action = parse_code_action(text)
    expect(isinstance(action, CodeAction), f"returned {type(action).__name__}")
    expect(action.stopped == (code_format.OUTPUT_STOP in text), f"stopped {action.stopped}")
    expect(action.code is None or (action.stopped and isinstance(action.code, str)), "code without a stop")
    depth = 0
    for ch in action.answer or "":
        depth += {"{": 1, "}": -1}.get(ch, 0)
        expect(depth >= 0, f"answer {action.answer!r} closes a brace it did not open")
    expect(depth == 0, f"answer {action.answer!r} leaves a brace open")
    expect(len(code_format.format_output(text)) <= 259, "output shown longer than 128 + ... + 128")


def code_text(src: Source) -> str:
    pieces = [small_text(src)]
    for _ in range(src.integer(0, 4)):
        body = expression(src) if src.chance(50) else small_text(src)
        pieces.append(src.pick((f"\n```python\nprint({body})\n```\n", f"```python\n{body}\n", f"\\boxed{{{body}}}",
                                f"\\boxed{{{body}", "}", "```output", "\n```\n")))
        pieces.append(small_text(src))
    text = "".join(pieces)
    return mutate(src, text) if src.chance(30) else text


# --- tools.code_turns: SimpleTIR's turns
TURN_STOP = stop_automaton([CODE_BLOCK_STOP])  # (delta, accept) over bytes


def check_code_turn(text: str) -> None:
    """A Turn: cut at the end of SimpleTIR's first block (its regex), where the two-part stop's
    byte automaton and the host's `first_stop` stop too; void exactly without a block or a box
    mark; the shown output bounded by 512 characters, the note and the wrapper."""
    turn = parse_turn(text)
    expect(isinstance(turn, Turn), f"returned {type(turn).__name__}")
    match = code_turns.CODE_BLOCK.search(text)
    expect((turn.code is None) == (match is None), f"code {turn.code!r} against the regex's {match}")
    expect(turn.end == (match.end() if match else len(text)), f"end {turn.end}")
    expect(turn.void == (match is None and "\\boxed{" not in text), f"void {turn.void}")
    expect(first_stop(text, [CODE_BLOCK_STOP])[0] == (match.end() if match else None), "host stop")
    state, stopped = 0, None
    for i, byte in enumerate(text.encode("utf-8", "surrogatepass")):  # sampled text has no surrogate: any bytes
        state = TURN_STOP[0][state, byte]
        if TURN_STOP[1][state]:
            stopped = i + 1
            break
    expect(stopped == (len(text[:match.end()].encode("utf-8", "surrogatepass")) if match else None),
           f"device stop at {stopped}")
    shown = code_turns.render_result(text, text if len(text) % 2 else "")
    expect(len(shown) <= len(code_turns.render_result("x" * 513, "")), f"output shown {len(shown)} characters")


def turn_text(src: Source) -> str:
    pieces = [small_text(src)]
    for _ in range(src.integer(0, 5)):
        body = expression(src) if src.chance(50) else small_text(src)
        pieces.append(src.pick((f"```python\n{body}\n```", f"```py\n{body}", f"```\n{body}\n", "\n```", "```",
                                "````\n", f"\\boxed{{{body}}}", "python\n", "\n")))
        pieces.append(small_text(src))
    text = "".join(pieces)
    return mutate(src, text) if src.chance(30) else text


# --- tools.formats: think + tool_call JSON
def check_tool_call_step(text: str) -> None:
    """A ToolCallStep with known problems and well-typed calls; its format checks and reward are defined."""
    step = parse_tool_call_step(text)
    expect(isinstance(step, ToolCallStep), f"returned {type(step).__name__}")
    expect(set(step.problems) <= set(STEP_PROBLEMS), f"problems {step.problems}")
    expect(all(isinstance(c, ToolCall) and isinstance(c.name, str) for c in step.calls), "a call without a name")
    expect(not step.valid_json or step.has_tool_call, "valid JSON without a closed tool_call block")
    expect(step.final_answer is None or isinstance(step.final_answer, str), "final answer not text")
    checks = formatting_checks(step, REGISTRY)
    expect(tuple(checks) == FORMAT_CHECKS and all(isinstance(v, bool) for v in checks.values()), f"checks {checks}")
    reward = formatting_reward(checks)
    expect(-DEFAULT_FORMAT_CAP <= reward <= DEFAULT_FORMAT_CAP, f"formatting reward {reward} out of [-c, c]")


def step_text(src: Source) -> str:
    calls = [{"name": src.pick(tuple(TOOLS)), "arguments": tool_arguments(src, src.pick(tuple(TOOLS)))}
             if src.chance(80) else json_value(src) for _ in range(src.integer(0, 4))]
    payload = json.dumps(calls if src.chance(85) else calls[0] if calls else json_value(src))
    def tag(text: str) -> str:  # each tag is there most of the time, so that a fair share of steps is valid
        return text if src.chance(90) else ""

    text = (tag("<think>") + small_text(src) + tag("</think>") + tag("<tool_call>") + payload + tag("</tool_call>")
            + (small_text(src) if src.chance(20) else ""))
    return mutate(src, text) if src.chance(30) else text


# --- tools.calculator
class _AuditWatch:
    """Audit events (sys.addaudithook) raised on this thread while watching. Parsing the expression
    raises "compile" (ast.parse compiles to a tree); anything else (exec, import, open, os.system,
    subprocess.Popen, ...) means the calculator ran or reached for code."""

    def __init__(self):
        self.local = threading.local()
        self.installed = False

    def hook(self, event: str, args) -> None:
        events = getattr(self.local, "events", None)
        if events is not None and event != "compile":
            events.append(event)

    def run(self, fn: Callable, *args) -> tuple[Any, list[str]]:
        if not self.installed:
            sys.addaudithook(self.hook)  # cannot be removed: it stays idle outside `run`
            self.installed = True
        self.local.events = []
        try:
            return fn(*args), self.local.events
        finally:
            events, self.local.events = self.local.events, None


AUDIT = _AuditWatch()
_CALC_ANSWER = re.compile(r"-?\d+(\.\d{1,10})?")


def _calculate(text: str) -> tuple[str | None, ToolError | None]:
    try:
        return calculate(text), None
    except ToolError as error:
        return None, error


def check_calculator(text: str) -> None:
    """A number of at most ~1,000 digits (and 10 decimals) or ToolError(invalid_value) with a message;
    nothing audited (no exec, import, open, process) while it runs; 1 s of CPU time at most."""
    (answer, error), events = AUDIT.run(_calculate, text)
    expect(not events, f"audit events while evaluating: {sorted(set(events))}")
    if error is not None:
        expect(error.error_type == INVALID_VALUE and isinstance(error.message, str) and error.message,
               f"rejected as {error.error_type}: {error.message!r}")
    else:
        expect(_CALC_ANSWER.fullmatch(answer) and len(answer) <= 1040, f"answer {answer[:80]!r} ({len(answer)} chars)")


CALCULATOR_TOOL = calculator_tool()


def check_calculator_tool(arguments: Any) -> None:
    """A ToolResult: a number, or invalid_value / malformed_arguments (never tool_failure)."""
    result = CALCULATOR_TOOL(arguments)
    expect(isinstance(result, ToolResult), f"returned {type(result).__name__}")
    expect(result.ok or result.error_type in (INVALID_VALUE, MALFORMED_ARGUMENTS),
           f"{result.error_type}: {result.message}")


def calculator_arguments(src: Source) -> Any:
    k = src.integer(0, 9)
    if k == 0:
        return json_value(src)
    arguments = {"expression": expression(src) if k > 2 else json_value(src)}
    if k == 1:
        arguments[small_text(src)] = json_value(src)
    return arguments


# --- every tool of the tool world
def _result_contract(result: Any, allowed: tuple[str, ...]) -> None:
    expect(isinstance(result, ToolResult), f"returned {type(result).__name__}")
    if result.ok:
        try:  # what the agent reads must be JSON; only tools that echo their arguments may echo NaN
            json.dumps(result.content, allow_nan=result.name in ECHO_TOOLS)
        except ValueError as error:
            raise Unexpected(f"content is not JSON ({error}): {str(result.content)[:200]}") from None
    else:
        expect(result.error_type in allowed, f"{result.error_type}: {result.message}")
        expect(isinstance(result.message, str) and 0 < len(result.message) <= 400, "error message empty or long")
    render_tool_responses([result])  # the observation can be written


def tool_check(name: str) -> Callable[[Any], None]:
    tool = TOOLS[name]

    def check(arguments: Any) -> None:
        """A ToolResult whose content is JSON, or malformed_arguments / invalid_value / not_found with a
        message (never tool_failure: with no injected failures, one means the tool raised)."""
        result = tool(arguments)
        expect(result.name == name, f"result named {result.name!r}")
        _result_contract(result, (MALFORMED_ARGUMENTS, INVALID_VALUE, NOT_FOUND))

    return check


def tool_from_text(name: str) -> Callable[[str], Any]:
    tool = TOOLS[name]
    properties, required = tool.parameters["properties"], tool.parameters["required"]

    def from_text(text: str) -> Any:
        ok, value = loads(text)
        if ok and isinstance(value, dict):
            return value.get("arguments") if value.get("name") == name else value
        # The text in every string argument; other required arguments take a plausible value.
        arguments = {}
        for key, schema in properties.items():
            if schema.get("type") == "string":
                arguments[key] = text
            elif key in required:
                arguments[key] = {"items": [3, 1, 2], "amount": 10, "value": 1, "days": 1}.get(key, text)
        return arguments

    return from_text


# --- tools.registry with injected failures
def check_registry(calls: list) -> None:
    """One typed result per call, in order: tool_failure only as an injected service failure, never a
    timeout; a call the registry says is invalid is answered malformed_arguments or unknown_tool."""
    results = REGISTRY.execute(calls)
    expect(isinstance(results, list) and len(results) == len(calls), f"{len(results)} results for {len(calls)} calls")
    allowed = tuple(t for t in ERROR_TYPES if t != TIMEOUT)
    for call, result in zip(calls, results):
        _result_contract(result, allowed)
        if result.error_type == TOOL_FAILURE:
            expect(SERVICE_DOWN in result.message, f"tool_failure: {result.message}")
        problem = REGISTRY.validation_error(call)
        expect(problem is None or isinstance(problem, str), f"validation_error gave {problem!r}")
        if problem is not None:
            expect(result.error_type in (MALFORMED_ARGUMENTS, UNKNOWN_TOOL),
                   f"invalid call ({problem}) answered {result.error_type}")


def registry_calls(src: Source) -> list:
    if src.chance(20):
        return list(parse_tool_call_step(step_text(src)).calls)
    return [raw_call(src) for _ in range(src.integer(0, 4))]


def registry_from_text(text: str) -> list:
    ok, value = loads(text)
    calls = [{"name": "calculate", "arguments": text}, {"name": text[:200], "arguments": {}}]
    if ok:
        calls += value if isinstance(value, list) else [value]
    return calls + list(parse_tool_call_step(text).calls)


# --- judges
_LABEL_SETS = ((PROCESS_LABELS, PROCESS_REWARDS), (OUTCOME_LABELS, OUTCOME_REWARDS),
               (TRAJECTORY_LABELS, TRAJECTORY_REWARDS))


def check_judge_label(value: tuple[str, int]) -> None:
    """None or one of the labels."""
    text, which = value
    labels = _LABEL_SETS[which][0]
    label = parse_label(text, labels)
    expect(label is None or label in labels, f"label {label!r}")


def judge_reply(src: Source) -> str:
    labels = src.pick(_LABEL_SETS)[0]
    label = src.pick(labels)
    k = src.integer(0, 4)
    if k == 0:
        return adversarial_text(src)
    if k == 1:
        return json.dumps({src.pick(("verdict", "label", "judgment", "answer", "x")): src.pick((label, True, 1, None))})
    marker = src.pick(("Verdict", "final verdict", "Judgement", "answer", "label", "decision", "rating", "", "verdict"))
    separator = "".join(src.pick((" ", ":", "=", "-", "is", "*", '"', "`", "[", "(", "\t", "\n"))
                        for _ in range(src.integer(0, 6)))
    if src.chance(20):
        separator += " " * src.integer(100, 3000)
    written = mutate(src, label) if src.chance(20) else src.pick((label, label.lower(), label.replace("_", " ")))
    text = f"{small_text(src)}{marker}{separator}{written}{small_text(src)}"
    return mutate(src, text) if k == 4 else text


def check_judge_majority(value: tuple[list, int, bool]) -> None:
    """A Verdict: a label from the set (scored by the mapping) or none with reason unparsed/tie; every
    reply counted once, as a vote or as unparsed; the verdict is JSON."""
    replies, which, scored = value
    labels, rewards = _LABEL_SETS[which]
    verdict = majority(replies, labels, rewards if scored else None)
    expect(isinstance(verdict, Verdict), f"returned {type(verdict).__name__}")
    expect(sum(verdict.votes.values()) + verdict.unparsed == len(replies), "replies lost or counted twice")
    if verdict.label is None:
        expect(verdict.failure_code in (FAILED_UNPARSED, FAILED_TIE), f"failed as {verdict.failed_reason!r}")
    else:
        expect(verdict.label in labels and verdict.failed_reason is None, f"label {verdict.label!r}")
        expect(verdict.score == (rewards[verdict.label] if scored else None), f"score {verdict.score}")
    json.dumps(verdict.to_json())


def check_judge_http_reply(payload: bytes) -> None:
    """The reply texts (a list of str) or the backend's retryable `malformed reply` error."""
    try:
        texts = _read_choices(payload)
    except _Retryable:
        return
    expect(isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts), f"texts {texts!r:.200}")


def http_payload(src: Source) -> bytes:
    k = src.integer(0, 5)
    if k == 0:
        return adversarial_text(src).encode("utf-8", "surrogatepass")
    if k == 1:
        return bytes(src.integer(0, 255) for _ in range(src.integer(0, 40)))

    def content():
        j = src.integer(0, 3)
        return (judge_reply(src) if j == 0 else json_value(src) if j == 1 else None if j == 2
                else [{"type": "text", "text": small_text(src)} if src.chance(80) else json_value(src)
                      for _ in range(src.integer(0, 3))])

    choices = [{"index": src.pick((0, 1, 2, "0", None, 1.5, math.nan)),
                "message": {"role": "assistant", "content": content()} if src.chance(90) else json_value(src)}
               if src.chance(90) else json_value(src) for _ in range(src.integer(0, 3))]
    body = {"id": "x", "choices": choices if src.chance(90) else json_value(src)}
    text = json.dumps(body)
    return (mutate(src, text) if src.chance(20) else text).encode("utf-8", "surrogatepass")


_RULE_LABELS = (rules.TRUE, rules.FALSE)
MAX_ANSWER_CHARS = 20_000  # an answer is bounded by the generation length (a few thousand tokens)


def check_judge_rules(value: tuple[str, str]) -> None:
    """The rule judges' readers of answers: a number or None; true/false (or unable_to_answer); GOOD/BAD."""
    prediction, reference = value
    prediction = prediction[:MAX_ANSWER_CHARS]
    extracted = rules.extract_number(prediction)
    expect(extracted is None or isinstance(extracted, Fraction), f"number {extracted!r}")
    expect(rules.gsm8k_outcome(prediction, reference) in _RULE_LABELS, "gsm8k outcome")
    expect(rules.hotpotqa_outcome(prediction, [reference]) in _RULE_LABELS, "hotpotqa outcome")
    expect(rules.toolworld_outcome(prediction, reference, True) in (*_RULE_LABELS, rules.UNABLE), "toolworld outcome")
    action = parse_tagged_action(prediction)
    step = rules.judge_step(reference, prediction, action.kind, action.content, (reference,))
    expect(step.verdict in (rules.GOOD, rules.BAD), f"process verdict {step.verdict!r}")


_REFERENCES = ("42", "$1,000.50", "Paris", "It is 21 C in Paris.", "unable to answer", "-3.25 and 7", "")


def rules_pair(src: Source) -> tuple[str, str]:
    prediction = tagged_text(src) if src.chance(30) else adversarial_text(src)
    return prediction, src.pick(_REFERENCES) if src.chance(80) else small_text(src)


# --- serve: the request side of the OpenAI-compatible server (no model needed)
@functools.cache
def chat_format():
    from steprl_jax.sampling import chat_format as module  # imported on use: sampling/ starts JAX
    return module


@functools.cache
def serve_app():
    from steprl_jax.serve import app as module
    return module


# A template with a place for tools and assistant tool calls (the server then passes calls natively).
_NATIVE = ("{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
           "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
           "{% if add_generation_prompt %}assistant:{% endif %}")


@functools.cache
def tokenizers() -> tuple:
    """Byte-level tokenizers (no model): ChatML without tools, a template with tool calls, and none."""
    from steprl_jax.models.chat import CHATML_TEMPLATE, byte_level_tokenizer

    return tuple(byte_level_tokenizer(template) for template in (CHATML_TEMPLATE, _NATIVE, None))


def _request_error(fn: Callable, *args) -> tuple[Any, Exception | None]:
    try:
        return fn(*args), None
    except chat_format().RequestError as error:
        return None, error


def check_serve_messages(value: tuple[Any, bool]) -> None:
    """Plain messages (role in system/user/assistant/tool, content text) or RequestError with a message."""
    messages, inline = value
    out, error = _request_error(chat_format().normalize_messages, messages, inline)
    if error is not None:
        expect(str(error), "RequestError without a message")
        return
    expect(isinstance(out, list) and len(out) == len(messages), "messages lost")
    for message in out:
        expect(message["role"] in ("system", "user", "assistant", "tool") and isinstance(message["content"], str),
               f"message {message!r:.200}")


def check_serve_prompt(value: tuple[Any, Any, int]) -> None:
    """The prompt text, or RequestError (bad messages or tools, or the template refused them)."""
    messages, tools, which = value
    prompt, error = _request_error(chat_format().render_prompt, tokenizers()[which], messages, tools)
    expect(error is not None or isinstance(prompt, str), f"prompt {prompt!r:.100}")


def check_serve_tool_calls(text: str) -> None:
    """(content, OpenAI tool calls): each call a function with a str name and str arguments."""
    content, calls = chat_format().parse_tool_calls(text)
    expect(isinstance(content, str) and isinstance(calls, list), "not (str, list)")
    for call in calls:
        expect(call["type"] == "function" and isinstance(call["function"]["name"], str)
               and isinstance(call["function"]["arguments"], str), f"call {call!r:.200}")


def check_serve_request(body: Any) -> None:
    """A ChatRequest within the server's limits, RequestError, or an HTTP error with a 4xx status."""
    app = serve_app()
    limits = app.ServerLimits()
    try:
        request = app.parse_chat_request(body, "fuzz-model", limits)
    except chat_format().RequestError as error:
        expect(str(error), "RequestError without a message")
        return
    except app._HttpError as error:
        expect(400 <= error.status < 500 and error.message, f"HTTP {error.status}: {error.message}")
        return
    expect(isinstance(request, app.ChatRequest), f"returned {type(request).__name__}")
    expect(isinstance(request.max_tokens, int) and 1 <= request.max_tokens <= limits.max_tokens,
           f"max_tokens {request.max_tokens!r}")
    expect(isinstance(request.stop, tuple) and isinstance(request.stream, bool), "stop or stream mistyped")


_BODY_FIELDS: dict[str, Callable[[Source], Any]] = {
    "model": lambda src: src.pick(("fuzz-model", None, "other", "")) if src.chance(80) else json_value(src),
    "stream": lambda src: src.pick((True, False, None, 1, "true")),
    "stream_options": lambda src: {"include_usage": json_value(src)} if src.chance(70) else json_value(src),
    "max_tokens": integer_edge, "max_completion_tokens": integer_edge,
    "tool_choice": lambda src: src.pick(("none", "auto", None)) if src.chance(80) else json_value(src),
    "temperature": number, "top_p": number, "n": integer_edge, "seed": integer_edge,
    "stop": lambda src: small_text(src) if src.chance(40) else [small_text(src) for _ in range(src.integer(0, 6))]
    if src.chance(70) else json_value(src),
}


def request_body(src: Source) -> Any:
    if src.chance(5):
        return json_value(src)
    body = {"messages": messages(src)}
    if src.chance(40):
        body["tools"] = request_tools(src)
    for field, draw in _BODY_FIELDS.items():
        if src.chance(30):
            body[field] = draw(src)
    return body


def body_from_text(text: str) -> Any:
    ok, value = loads(text)
    if ok:
        return value
    return {"model": text, "messages": messages_from_text(text), "stop": text, "tool_choice": text}


_ROLES = ("system", "developer", "user", "assistant", "tool", "bot", "", None, 5)


def openai_call(src: Source) -> Any:
    if src.chance(5):
        return json_value(src)
    name = src.pick(tuple(TOOLS)) if src.chance(80) else json_value(src)
    arguments = tool_arguments(src, name) if isinstance(name, str) and name in TOOLS else json_value(src)
    if src.chance(70):
        arguments = json.dumps(arguments) if src.chance(80) else adversarial_text(src)
    function = {"name": name, "arguments": arguments} if src.chance(95) else json_value(src)
    return {"id": small_text(src), "type": "function", "function": function}


def message(src: Source) -> Any:
    if src.chance(5):
        return json_value(src)
    k = src.integer(0, 5)
    content = (adversarial_text(src) if k <= 1 else small_text(src) if k == 2 else None if k == 3
               else [{"type": "text", "text": small_text(src)} if src.chance(85) else json_value(src)
                     for _ in range(src.integer(0, 3))] if k == 4 else json_value(src))
    out = {"role": src.pick(_ROLES) if src.chance(20) else src.pick(_ROLES[:5])}
    if src.chance(95):
        out["content"] = content
    if src.chance(30):
        out["tool_calls"] = ([openai_call(src) for _ in range(src.integer(0, 3))] if src.chance(90)
                             else json_value(src))
    if src.chance(10):
        out["name"] = small_text(src) if src.chance(70) else json_value(src)
    return out


def messages(src: Source) -> Any:
    return [message(src) for _ in range(src.integer(0, 5))] if src.chance(92) else json_value(src)


def messages_from_text(text: str) -> Any:
    ok, value = loads(text)
    if ok and isinstance(value, list):
        return value
    return [{"role": "user", "content": text},
            {"role": "assistant", "content": text, "tool_calls": [
                {"function": {"name": "f", "arguments": text}}, {"function": {"name": text, "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "text", "text": text}], "name": text}]


def request_tools(src: Source) -> Any:
    k = src.integer(0, 4)
    schemas = REGISTRY.openai_schemas()
    if k == 0:
        return None
    if k == 1:
        return schemas[:src.integer(0, len(schemas))]
    if k == 2:
        return [json_value(src) for _ in range(src.integer(0, 3))]
    if k == 3:
        return [{"type": "function", "function": {"name": small_text(src), "parameters": json_value(src)}}]
    return json_value(src)


# ------------------------------------------------------------------ the registry of targets
TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("formats.tagged_action", check_tagged_action, tagged_text, lambda s: s, 250),
    Target("formats.tool_call_step", check_tool_call_step, step_text, lambda s: s, 250),
    Target("code_format.action", check_code_action, code_text, lambda s: s, 250),
    Target("code_turns.turn", check_code_turn, turn_text, lambda s: s, 250),
    Target("calculator", check_calculator, lambda src: expression(src) if src.chance(80) else adversarial_text(src),
           lambda s: s, 400, weight=6, cpu_limit_s=1.0),
    Target("calculator.tool", check_calculator_tool, calculator_arguments, lambda s: {"expression": s}, 150),
    *[Target(f"tool.{name}", tool_check(name), functools.partial(tool_arguments, name=name), tool_from_text(name),
             60, weight=1) for name in TOOLS],
    Target("tools.registry", check_registry, registry_calls, registry_from_text, 200),
    Target("judges.parse_label", check_judge_label, lambda src: (judge_reply(src), src.integer(0, 2)),
           lambda s: (s, len(s) % 3), 300),
    Target("judges.majority", check_judge_majority,
           lambda src: ([judge_reply(src) for _ in range(src.integer(0, 5))], src.integer(0, 2), src.chance(50)),
           lambda s: ([s, s, "Verdict: GOOD", "YES", "true"], len(s) % 3, True), 150),
    Target("judges.http_reply", check_judge_http_reply, http_payload,
           lambda s: s.encode("utf-8", "surrogatepass"), 200),
    Target("judges.rules", check_judge_rules, rules_pair, lambda s: (s, "42"), 200),
    Target("serve.normalize_messages", check_serve_messages, lambda src: (messages(src), src.chance(50)),
           lambda s: (messages_from_text(s), True), 200, setup=chat_format),
    Target("serve.render_prompt", check_serve_prompt,
           lambda src: (messages(src), request_tools(src), src.integer(0, 2)),
           lambda s: (messages_from_text(s), None, len(s) % 3), 100, setup=tokenizers),
    Target("serve.parse_chat_request", check_serve_request, request_body, body_from_text, 200,
           setup=serve_app),
    Target("serve.parse_tool_calls", check_serve_tool_calls,
           lambda src: step_text(src) if src.chance(70) else adversarial_text(src), lambda s: s, 200,
           setup=chat_format),
]}
