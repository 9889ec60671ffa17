"""Rule judges: offline stand-ins for the LLM outcome and process judges.

Outcome judges return "true" / "false" / "unable_to_answer" (METHODS 2.2); the process
judge returns GOOD / BAD with its reasons (METHODS 1.3). Heuristics are documented per
function so that their verdicts can be reproduced by hand.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import string
from fractions import Fraction
from typing import Sequence

from steprl_jax.tools.calculator import evaluate
from steprl_jax.tools.protocol import ToolError

TRUE, FALSE, UNABLE = "true", "false", "unable_to_answer"
OUTCOME_REWARD = {TRUE: 1.0, FALSE: -1.0, UNABLE: 0.0}
GOOD, BAD = "GOOD", "BAD"

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


# ------------------------------------------------------------------ numbers
def extract_number(text: str) -> Fraction | None:
    """The last number written in `text`: `$1,000.50 dollars` -> 1000.5; None when there is none."""
    if not isinstance(text, str):
        return None
    matches = _NUMBER.findall(text[-2000:])
    if not matches:
        return None
    token = matches[-1].replace(",", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_outcome(prediction: str | None, gold: str) -> str:
    """Numeric equivalence: `10`, `10.00`, `$10`, `10 dollars` all match gold `10`. A missing answer is false."""
    gold_value, value = extract_number(gold), extract_number(prediction or "")
    return TRUE if value is not None and gold_value is not None and value == gold_value else FALSE


# Predictions longer than this are wrong without parsing (sympy on a page of LaTeX can take minutes).
MAX_VERIFIED_CHARS = 1000


def math_verify_outcome(prediction: str | None, gold: str) -> str:
    """ToRL's check: the predicted answer (the content of a \\boxed{}) equals the gold number by
    math-verify (`\\frac{144}{2}`, `72.0` and `72` all match gold `72`). A missing answer is false.

    math-verify bounds its work with SIGALRM, which only the main thread may set (the loops judge
    there): 1 s to parse and 1 s to compare (sympy on \\boxed{9^{9^{9^9}}} would run for minutes).
    Elsewhere it runs without that bound; only the length cap above stands in."""
    import threading

    from math_verify import parse, verify

    gold_value = extract_number(gold if isinstance(gold, str) else str(gold))
    if not prediction or not isinstance(prediction, str) or gold_value is None:
        return FALSE
    if len(prediction) > MAX_VERIFIED_CHARS:
        return FALSE
    timeout = 1 if threading.current_thread() is threading.main_thread() else None
    gold_text = str(gold_value.numerator) if gold_value.denominator == 1 else \
        f"\\frac{{{gold_value.numerator}}}{{{gold_value.denominator}}}"
    try:
        target = parse("\\boxed{" + prediction + "}", parsing_timeout=timeout)
        reference = parse(f"${gold_text}$", parsing_timeout=timeout)
        return TRUE if target and verify(reference, target, timeout_seconds=timeout) else FALSE
    except Exception:  # math-verify's own timeouts and parser failures: not a match
        return FALSE


# ------------------------------------------------------------------ HotPotQA
def normalize_answer(text: str) -> str:
    """SQuAD/HotPotQA normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def hotpotqa_scores(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """Best exact match and token F1 over the gold spans."""
    golds = list(golds) or [""]
    return {"em": max(float(normalize_answer(prediction) == normalize_answer(g)) for g in golds),
            "f1": max(token_f1(prediction, g) for g in golds)}


def hotpotqa_outcome(prediction: str | None, golds: Sequence[str], partial_f1: float | None = None) -> str:
    """True on normalised exact match; with `partial_f1`, also when token F1 reaches it (e.g. 0.8)."""
    if not prediction:
        return FALSE
    scores = hotpotqa_scores(prediction, golds)
    if scores["em"] == 1.0 or (partial_f1 is not None and scores["f1"] >= partial_f1):
        return TRUE
    return FALSE


# ------------------------------------------------------------------ tool world
_DECLINE = re.compile(r"\b(unable|cannot|can't|could not|couldn't|not available|unavailable|sorry|don't know|"
                      r"do not know|no data)\b", re.IGNORECASE)


def declined(answer: str | None) -> bool:
    return answer is None or not answer.strip() or bool(_DECLINE.search(answer))


def _numbers(text: str) -> list[Fraction]:
    out = []
    for token in _NUMBER.findall(text):
        try:
            out.append(Fraction(token.replace(",", "")))
        except (ValueError, ZeroDivisionError):
            pass
    return out


def toolworld_answer_matches(answer: str, reference: str, rel_tol: float = 0.01) -> bool:
    """Every number of the reference appears in the answer (within `rel_tol`), and every word
    of the reference (after normalisation, numbers aside) appears in the answer."""
    ref_numbers, ans_numbers = _numbers(reference), _numbers(answer)
    for target in ref_numbers:
        tolerance = abs(target) * Fraction(rel_tol) if target else Fraction(rel_tol)
        if not any(abs(value - target) <= tolerance for value in ans_numbers):
            return False
    ref_words = [w for w in normalize_answer(reference).split() if not _NUMBER.fullmatch(w)]
    answer_words = set(normalize_answer(answer).split())
    return all(w in answer_words for w in ref_words)


def toolworld_outcome(answer: str | None, reference: str, tool_failed: bool, rel_tol: float = 0.01) -> str:
    """METHODS 2.2: true on a matching answer; `unable_to_answer` when the agent declined (or gave
    no answer) after a needed tool failed; false otherwise (wrong answer, or declining without cause)."""
    if answer is not None and not declined(answer) and toolworld_answer_matches(answer, reference, rel_tol):
        return TRUE
    if tool_failed and declined(answer):
        return UNABLE
    return FALSE


# ------------------------------------------------------------------ process judge
@dataclasses.dataclass(frozen=True)
class ProcessVerdict:
    verdict: str  # GOOD | BAD
    reasons: tuple[str, ...]

    @property
    def good(self) -> bool:
        return self.verdict == GOOD


_STOP = {"the", "a", "an", "of", "in", "on", "at", "to", "for", "and", "or", "is", "was", "were", "are", "what",
         "which", "who", "whom", "when", "where", "how", "did", "does", "do", "by", "with", "that", "this", "from"}


def _content_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if w not in _STOP}


def judge_step(question: str, context: str, action_kind: str | None, action_content: str | None,
               previous_queries: Sequence[str] = ()) -> ProcessVerdict:
    """GOOD/BAD for one SWiRL action, seeing only the question and what came before (no gold answer).

    * math: the expression evaluates, and each of its numbers appears in the question or the
      context so far (small constants 0-10, 12, 24, 60, 100 and 1000 are always allowed).
    * search: non-empty, not a repeat of an earlier query, and shares a content word with the
      question or the context.
    * answer: non-empty and supported: its number (if any) or most of its content words appear
      in the context (earlier observations) or the question.
    * no parsable action: BAD.
    """
    reasons: list[str] = []
    content = (action_content or "").strip()
    seen_text = f"{question}\n{context}"
    if action_kind is None or not content:
        return ProcessVerdict(BAD, ("no well-formed action",))
    if action_kind == "math":
        try:
            evaluate(content)
        except ToolError as err:
            reasons.append(f"invalid expression: {err.message}")
        allowed = set(_numbers(seen_text)) | {Fraction(n) for n in (*range(11), 12, 24, 60, 100, 1000)}
        unsupported = [str(n) for n in _numbers(content.replace("-", " ")) if n not in allowed]
        if unsupported:
            reasons.append(f"numbers not from the question or earlier results: {', '.join(unsupported[:5])}")
    elif action_kind == "search":
        if normalize_answer(content) in {normalize_answer(q) for q in previous_queries}:
            reasons.append("repeats an earlier query")
        if not _content_words(content) & _content_words(seen_text):
            reasons.append("shares no content with the question or earlier results")
    elif action_kind == "answer":
        value = extract_number(content)
        words = _content_words(content)
        seen_words = _content_words(seen_text)
        if value is not None and _NUMBER.fullmatch(content.replace("$", "").strip().rstrip(".")):
            if value not in set(_numbers(seen_text)):
                reasons.append("the number in the answer does not appear in earlier observations")
        elif words and len(words & seen_words) < max(1, len(words) // 2):
            reasons.append("the answer is not supported by earlier observations")
    else:
        reasons.append(f"unknown action type {action_kind!r}")
    return ProcessVerdict(BAD if reasons else GOOD, tuple(reasons))


# ------------------------------------------------------------------ reference-guided process judge
# A quantity matches a solution's when equal within this relative tolerance: solutions write
# rounded decimals (`3.3333333333` for 10/3).
QUANTITY_REL_TOL = Fraction(1, 10**6)


def _same_quantity(value: Fraction, quantity: Fraction) -> bool:
    return abs(value - quantity) <= QUANTITY_REL_TOL * max(Fraction(1), abs(quantity))


def judge_step_against_solution(action_kind: str | None, action_content: str | None, quantities: Sequence[str],
                                answer: str) -> ProcessVerdict:
    """GOOD/BAD for one SWiRL math action, seeing a correct solution: its `quantities` (every value
    it computes, e.g. GSM8K's `<<48/2=24>>` values) and its final `answer`.

    * math: the expression evaluates and its value is one of the solution's quantities or the
      answer (a step that skips ahead to the answer in one expression is reasonable).
    * answer: its number equals the answer (`gsm8k_outcome`).
    * anything else (a search, no parsable action): BAD.

    A judge with the golden solution in hand, for measuring (a stand-in for a strong LLM judge);
    `judge_step` is the one that sees no answer."""
    content = (action_content or "").strip()
    if action_kind is None or not content:
        return ProcessVerdict(BAD, ("no well-formed action",))
    if action_kind == "answer":
        if gsm8k_outcome(content, answer) == TRUE:
            return ProcessVerdict(GOOD, ())
        return ProcessVerdict(BAD, (f"the answer is not the solution's {answer}",))
    if action_kind != "math":
        return ProcessVerdict(BAD, (f"a {action_kind} action has no place in a math solution",))
    try:
        value = evaluate(content)
    except ToolError as err:
        return ProcessVerdict(BAD, (f"invalid expression: {err.message}",))
    known = [n for q in (*quantities, answer) if (n := extract_number(str(q))) is not None]
    if any(_same_quantity(value, q) for q in known):
        return ProcessVerdict(GOOD, ())
    return ProcessVerdict(BAD, (f"computes {float(value):g}, no quantity of the solution",))
