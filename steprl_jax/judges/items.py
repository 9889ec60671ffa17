"""What each judge is asked about, and how to read those items off rollout records.

The helpers take any object with the fields of `steprl_jax.agents.records.Trajectory` (question,
steps with action_text / observation_text / tool_results, final_answer, reference_answer), so the
judges do not depend on the agents package.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from steprl_jax.judges.prompts import History
from steprl_jax.tools.protocol import TOOL_FAILURE


@dataclasses.dataclass(frozen=True)
class StepItem:
    """One step for the process judge. It has no field for a golden answer, by construction."""

    question: str
    history: History  # earlier actions and observations (text, or chat messages)
    action: str  # the step being judged


@dataclasses.dataclass(frozen=True)
class SolutionReference:
    """A correct solution as a reference-guided step judge sees it: every quantity it computes, in
    order, and the final answer (`rules.judge_step_against_solution`)."""

    quantities: tuple[str, ...]
    answer: str


@dataclasses.dataclass(frozen=True)
class OutcomeItem:
    question: str
    predicted: str | None  # None when the agent gave no final answer
    answer_key: Any  # a string, or a list of acceptable answers (HotPotQA aliases)


@dataclasses.dataclass(frozen=True)
class TrajectoryItem:
    """A finished trajectory for PORTool's judge; the reference when one exists.

    `final_answer` and `tool_failed` are read by rule judges; model judges see the trajectory.
    """

    question: str
    trajectory: History
    reference: Any = None
    final_answer: str | None = None
    tool_failed: bool = False


def _observation(step: Any) -> str:
    results = getattr(step, "tool_results", None)
    if results:
        return json.dumps(list(results), ensure_ascii=False)
    return (getattr(step, "observation_text", "") or "").strip()


def step_messages(steps: Sequence[Any]) -> list[dict]:
    """Recorded steps as chat messages: each action, then what the tools returned (errors included)."""
    messages = []
    for step in steps:
        messages.append({"role": "assistant", "content": step.action_text})
        observation = _observation(step)
        if observation:
            messages.append({"role": "tool", "content": observation})
    return messages


def step_items(trajectory: Any) -> list[StepItem]:
    """SWiRL: one process item per action, each seeing only the steps before it."""
    return [StepItem(trajectory.question, step_messages(trajectory.steps[:i]), step.action_text)
            for i, step in enumerate(trajectory.steps)]


def outcome_item(trajectory: Any) -> OutcomeItem:
    return OutcomeItem(trajectory.question, trajectory.final_answer, trajectory.reference_answer)


def tool_failed(trajectory_or_steps: Any) -> bool:
    """Whether a tool failed in a trajectory (or a list of its steps): some result's error type is
    `tool_failure`. The agent's own mistakes (malformed arguments, unknown tools, invalid values) do
    not count: a declined answer is "unable_to_answer" only when the tools defeated the trajectory."""
    steps = getattr(trajectory_or_steps, "steps", trajectory_or_steps)
    return any(isinstance(r, dict) and isinstance(r.get("error"), dict) and r["error"].get("type") == TOOL_FAILURE
               for s in steps for r in (getattr(s, "tool_results", None) or ()))


def trajectory_item(trajectory: Any) -> TrajectoryItem:
    return TrajectoryItem(trajectory.question, step_messages(trajectory.steps), trajectory.reference_answer,
                          trajectory.final_answer, tool_failed(trajectory))
