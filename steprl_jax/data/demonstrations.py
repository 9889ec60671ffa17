"""Expert demonstrations in the action formats, as text segments another module can tokenise.

A demonstration is a prompt followed by steps; each step is the action text (what the
policy would generate) and the observation text appended after it (empty after the final
answer). `as_messages()` gives the same content as chat messages: the action as `assistant`,
the observation as `tool`.
"""
from __future__ import annotations

import dataclasses
import json

from steprl_jax.tools import code_turns
from steprl_jax.tools.code_format import render_code_action, render_observation
from steprl_jax.tools.formats import (
    render_tagged_action, render_tagged_observation, render_tool_call_step, render_tool_responses)
from steprl_jax.tools.protocol import ToolResult


@dataclasses.dataclass(frozen=True)
class DemoStep:
    action: str
    observation: str = ""
    # The action ends the assistant turn (the policy then writes its end-of-turn token), as a final
    # answer in the code formats does; the other actions end at a stop string.
    ends_turn: bool = False


@dataclasses.dataclass(frozen=True)
class Demonstration:
    prompt: str
    steps: tuple[DemoStep, ...]
    format: str  # "tags" | "tool_call" | "code" | "code_turns" | "flow"

    def as_text(self) -> str:
        return self.prompt + "\n" + "".join(step.action + step.observation for step in self.steps)

    def as_messages(self, system: str | None = None) -> list[dict]:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": self.prompt})
        for step in self.steps:
            messages.append({"role": "assistant", "content": step.action})
            if step.observation:
                messages.append({"role": "tool", "content": step.observation.strip()})
        return messages


def tagged_demonstration(question: str, steps: list[tuple[str, str, str]], answer: str) -> Demonstration:
    """SWiRL tags: `steps` are (kind, content, result) with kind "search" or "math"."""
    rendered = [DemoStep(render_tagged_action(kind, content), render_tagged_observation(content, result))
                for kind, content, result in steps]
    rendered.append(DemoStep(render_tagged_action("answer", answer)))
    return Demonstration(question, tuple(rendered), "tags")


def code_demonstration(question: str, expressions: list[str], outputs: list[str], answer: str) -> Demonstration:
    """ToRL's code format: one python block printing each expression, its output (`outputs`, one
    line per expression, as Python prints them), then the boxed answer."""
    code = _printing(expressions)
    run = DemoStep(render_code_action("Let me compute this with Python.", code), render_observation("\n".join(outputs)))
    return Demonstration(question, (run, _boxed_answer(answer)), "code")


def code_turns_demonstration(question: str, expressions: list[str], outputs: list[str],
                             answer: str) -> Demonstration:
    """SimpleTIR's multi-turn code format: a turn whose one block prints each expression, its
    result as the sandbox shows it (`outputs`, one line per expression), then a turn with the
    boxed answer."""
    code = _printing(expressions)
    stdout = "".join(line + "\n" for line in outputs)
    run = DemoStep(f"Let me compute this with Python.\n```python\n{code}\n```", code_turns.render_result(stdout, ""))
    return Demonstration(question, (run, _boxed_answer(answer)), "code_turns")


def flow_planner_demonstration(question: str, expressions: list[str], tool_name: str) -> Demonstration:
    """AgentFlow's planner, first turn: one step that hands every gold computation to the python
    tool (`tool_name`) in the Justification / Context / Sub-Goal / Tool Name format the planner's
    prompt asks for; the frozen executor writes the code, the frozen solution generator answers.
    The reply ends its turn (each planner call is a turn of its own)."""
    if not expressions:
        raise ValueError("a planner demonstration needs at least one step to compute")
    if len(expressions) == 1:
        goal = f"Calculate {expressions[0]} and print the result."
    else:
        goal = f"Calculate {', then '.join(expressions)}, and print each result."
    reply = ("Justification: The query needs exact arithmetic, which Python computes reliably.\n"
             "Context: The numbers given in the query.\n"
             f"Sub-Goal: {goal}\n"
             f"Tool Name: {tool_name}")
    return Demonstration(question, (DemoStep(reply, ends_turn=True),), "flow")


def _printing(expressions: list[str]) -> str:
    if not expressions:
        raise ValueError("a code demonstration needs at least one step to compute")
    return "\n".join(f"print({e})" for e in expressions)


def _boxed_answer(answer: str) -> DemoStep:
    return DemoStep(f"The answer is \\boxed{{{answer}}}.", ends_turn=True)


def _thought(calls) -> str:
    names = ", ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in calls)
    if len(calls) > 1:
        return f"These calls are independent, so I make them together: {names}."
    return f"Next I call {names}."


def tool_call_demonstration(question: str, plan, results: list[list[ToolResult]]) -> Demonstration:
    """Think + tool_call: one step per plan step; `results` are the executed results of every
    non-final step. The final step calls `response_gen`."""
    steps = []
    for calls, step_results in zip(plan[:-1], results):
        steps.append(DemoStep(render_tool_call_step(_thought(calls), calls), render_tool_responses(step_results)))
    steps.append(DemoStep(render_tool_call_step("I have what I need to answer.", plan[-1])))
    return Demonstration(question, tuple(steps), "tool_call")
