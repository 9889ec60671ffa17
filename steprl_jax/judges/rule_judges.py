"""The rule judges of `rules.py` behind the same interface as the model judges.

    RuleProcessJudge().judge_steps(items) / RuleOutcomeJudge("gsm8k").judge(items) /
    RuleTrajectoryJudge("toolworld").judge(items)  -> list[Verdict]
    ReferenceProcessJudge().judge([(step_item, solution_reference), ...])

Outcome rules by name (`OUTCOME_RULES`): gsm8k, hotpotqa, toolworld, math_verify (ToRL's check).

They are offline stand-ins: deterministic, instant, no votes. A rule judge's `raw` holds its reasons.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from steprl_jax.judges import rules
from steprl_jax.judges.items import OutcomeItem, SolutionReference, StepItem, TrajectoryItem
from steprl_jax.judges.model_judges import JudgeStats
from steprl_jax.judges.prompts import render_history
from steprl_jax.judges.verdicts import (FAILED_NO_REFERENCE, OUTCOME_REWARDS, PROCESS_REWARDS, TRAJECTORY_REWARDS,
                                        Verdict, failed_verdict)
from steprl_jax.tools.formats import parse_tagged_action

_SEARCH_QUERY = re.compile(r"<search_query>(.*?)</search_query>", re.DOTALL)


def _decided(label: str, rewards: dict, reasons: Sequence[str] = ()) -> Verdict:
    return Verdict(label, ("; ".join(reasons),) if reasons else (), None, {label: 1}, 0, rewards[label])


class _RuleJudge:
    def __init__(self):
        self.stats = JudgeStats()

    def judge_one(self, item: Any) -> Verdict:
        verdict = self._decide(item)
        self.stats.record(verdict)
        return verdict

    def judge(self, items: Sequence[Any]) -> list[Verdict]:
        return [self.judge_one(item) for item in items]

    def _decide(self, item: Any) -> Verdict:
        raise NotImplementedError


class RuleProcessJudge(_RuleJudge):
    """GOOD/BAD for a SWiRL tag action from `rules.judge_step` (question and earlier context only)."""

    def _decide(self, item: StepItem) -> Verdict:
        context = "" if not item.history else render_history(item.history)
        action = parse_tagged_action(item.action)
        kind = action.kind if "unclosed_tag" not in action.problems else None
        previous = [q.strip() for q in _SEARCH_QUERY.findall(context)]
        decision = rules.judge_step(item.question, context, kind, action.content, previous)
        return _decided(decision.verdict, PROCESS_REWARDS, decision.reasons)

    def judge_steps(self, items: Sequence[StepItem]) -> list[Verdict]:
        return self.judge(items)


class ReferenceProcessJudge(_RuleJudge):
    """GOOD/BAD for a SWiRL tag action against a correct solution: items are (StepItem,
    SolutionReference) pairs (`rules.judge_step_against_solution`).

    It sees the golden solution, so it measures (a stand-in for a strong LLM judge in experiments)
    and is never SWiRL's filter by default: `judge.process.kind=reference` opts in."""

    def _decide(self, item: tuple[StepItem, SolutionReference]) -> Verdict:
        step, reference = item
        action = parse_tagged_action(step.action)
        kind = action.kind if "unclosed_tag" not in action.problems else None
        decision = rules.judge_step_against_solution(kind, action.content, reference.quantities, reference.answer)
        return _decided(decision.verdict, PROCESS_REWARDS, decision.reasons)


def _hotpotqa(predicted, reference, tool_failed, partial_f1, rel_tol) -> str:
    golds = list(reference) if isinstance(reference, (list, tuple)) else [str(reference)]
    return rules.hotpotqa_outcome(predicted, golds, partial_f1)


# The answer checks by name: (predicted, reference, tool_failed, partial_f1, rel_tol) -> verdict.
_OUTCOME_CHECKS = {
    "gsm8k": lambda predicted, reference, *_: rules.gsm8k_outcome(predicted, str(reference)),
    "hotpotqa": _hotpotqa,
    "toolworld": lambda predicted, reference, tool_failed, partial_f1, rel_tol:
        rules.toolworld_outcome(predicted, str(reference), tool_failed, rel_tol),
    "math_verify": lambda predicted, reference, *_: rules.math_verify_outcome(predicted, str(reference)),
}
OUTCOME_RULES = tuple(_OUTCOME_CHECKS)


def _rule_outcome(rule: str, predicted: str | None, reference: Any, tool_failed: bool, partial_f1: float | None,
                  rel_tol: float) -> str:
    return _OUTCOME_CHECKS[rule](predicted, reference, tool_failed, partial_f1, rel_tol)


class _OutcomeRule(_RuleJudge):
    def __init__(self, rule: str = "gsm8k", partial_f1: float | None = None, rel_tol: float = 0.01):
        if rule not in OUTCOME_RULES:
            raise ValueError(f"unknown outcome rule {rule!r}; expected one of {OUTCOME_RULES}")
        super().__init__()
        self.rule, self.partial_f1, self.rel_tol = rule, partial_f1, rel_tol


class RuleOutcomeJudge(_OutcomeRule):
    """YES/NO against the answer key (`unable_to_answer` from the tool-world rule counts as NO)."""

    def _decide(self, item: OutcomeItem) -> Verdict:
        if item.answer_key is None:
            return failed_verdict(f"{FAILED_NO_REFERENCE}: the item has no answer key")
        outcome = _rule_outcome(self.rule, item.predicted, item.answer_key, False, self.partial_f1, self.rel_tol)
        return _decided("YES" if outcome == rules.TRUE else "NO", OUTCOME_REWARDS)


class RuleTrajectoryJudge(_OutcomeRule):
    """true / false / unable_to_answer from the final answer, the reference and whether a tool failed."""

    def _decide(self, item: TrajectoryItem) -> Verdict:
        if item.reference is None:
            return failed_verdict(f"{FAILED_NO_REFERENCE}: rule judges need a reference answer")
        outcome = _rule_outcome(self.rule, item.final_answer, item.reference, item.tool_failed, self.partial_f1,
                                self.rel_tol)
        return _decided(outcome, TRAJECTORY_REWARDS)
