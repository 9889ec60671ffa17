"""Verdicts: parsing one judge reply into a label (or "unparsed"), and the majority over `k` replies.

A reply that cannot be read is never guessed: it is counted as unparsed, and a verdict whose
replies are all unparsed (or whose top labels tie) carries no label and says why in
`failed_reason`. Callers count such verdicts instead of treating them as any label.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from typing import Mapping, Sequence

# The label sets of the three model judges, and the reward each label maps to by default.
PROCESS_LABELS = ("GOOD", "BAD")
OUTCOME_LABELS = ("YES", "NO")
TRAJECTORY_LABELS = ("true", "false", "unable_to_answer")
PROCESS_REWARDS = {"GOOD": 1.0, "BAD": 0.0}
OUTCOME_REWARDS = {"YES": 1.0, "NO": 0.0}
TRAJECTORY_REWARDS = {"true": 1.0, "false": -1.0, "unable_to_answer": 0.0}

# Why a verdict has no label. Short stable codes (the detail follows after ": ").
FAILED_BACKEND = "backend"  # the endpoint/model never answered (after retries)
FAILED_UNPARSED = "unparsed"  # every reply was unreadable
FAILED_TIE = "tie"  # the most frequent labels tie
FAILED_NO_REFERENCE = "no_reference"  # a rule judge cannot decide without a reference answer


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A judge's decision on one item.

    label: the majority label, or None when the verdict failed.
    raw: every reply text the judge model gave (empty for a backend failure and for rule judges
        that have no text).
    failed_reason: None, or "<code>: <detail>" with code in {backend, unparsed, tie, no_reference}.
    votes: label -> number of replies with that label (parsed replies only).
    unparsed: number of replies that could not be read.
    score: the reward of `label` under the judge's mapping, None when the verdict failed.
    """

    label: str | None
    raw: tuple[str, ...] = ()
    failed_reason: str | None = None
    votes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    unparsed: int = 0
    score: float | None = None

    @property
    def ok(self) -> bool:
        return self.label is not None

    @property
    def failure_code(self) -> str | None:
        return None if self.failed_reason is None else self.failed_reason.split(":", 1)[0]

    def to_json(self) -> dict:
        return {"label": self.label, "raw": list(self.raw), "failed_reason": self.failed_reason,
                "votes": dict(self.votes), "unparsed": self.unparsed, "score": self.score}


def failed_verdict(reason: str) -> Verdict:
    return Verdict(label=None, failed_reason=reason)


# ------------------------------------------------------------------ parsing one reply
# Written labels may use spaces or hyphens where the canonical label has underscores.
def _label_pattern(label: str) -> str:
    return r"[\s_\-]+".join(re.escape(part) for part in label.split("_"))


def _alternation(labels: Sequence[str]) -> str:
    # Longest first, so that "unable_to_answer" is not read as something shorter.
    return "|".join(_label_pattern(l) for l in sorted(labels, key=len, reverse=True))


def _canonical(found: str, labels: Sequence[str]) -> str:
    # casefold, as the regular expressions' IGNORECASE does: "YEſ" (long s) matched YES, and .lower() keeps the ſ.
    key = re.sub(r"[\s_\-]+", "_", found.strip()).casefold()
    return next(l for l in labels if l.casefold() == key)


_MARKERS = r"(?:final\s+)?(?:verdict|judg(?:e)?ment|answer|label|decision|rating)"
# Between a marker and its label: spaces, an optional "is", one of `:=-`, opening quotes or brackets.
# Each part starts with a character the part before cannot match, so matching takes linear time (adjacent
# `\s*` runs made a reply of "verdict" and a few hundred spaces take minutes).
_SEPARATOR = r"\s*(?:is\s*)?(?:[:=\-]\s*)?(?:[\*\"'`\[\(]\s*)*"


def parse_label(text: str, labels: Sequence[str]) -> str | None:
    """The label a reply gives, or None when it cannot be read without guessing.

    In order: a JSON object with a "verdict"/"label" field; the last "Verdict: X" style line;
    a reply that is only the label (quotes, markdown and punctuation aside); a reply in which
    exactly one of the labels occurs as a word. Two different labels and no marker: unparsed.
    """
    if not isinstance(text, str):
        return None
    stripped = text.strip()
    alternation = _alternation(labels)
    from_json = _label_from_json(stripped, labels)
    if from_json is not None:
        return from_json
    marked = re.findall(rf"{_MARKERS}{_SEPARATOR}({alternation})\b", stripped,
                        flags=re.IGNORECASE)
    if marked:
        return _canonical(marked[-1], labels)
    bare = re.fullmatch(rf"[\s\*\"'`\[\(]*({alternation})[\s\*\"'`\]\)\.!]*", stripped, flags=re.IGNORECASE)
    if bare:
        return _canonical(bare.group(1), labels)
    found = {_canonical(m, labels) for m in re.findall(rf"(?<![\w])({alternation})(?![\w])", stripped,
                                                       flags=re.IGNORECASE)}
    return found.pop() if len(found) == 1 else None


def _label_from_json(text: str, labels: Sequence[str]) -> str | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start or end - start > 20_000:
        return None
    try:
        value = json.loads(text[start:end + 1])
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    for field in ("verdict", "label", "judgment", "answer"):
        candidate = value.get(field)
        if isinstance(candidate, bool):  # {"verdict": true} for the true/false label set
            candidate = "true" if candidate else "false"
        if isinstance(candidate, str):
            key = re.sub(r"[\s_\-]+", "_", candidate.strip()).lower()
            for label in labels:
                if label.lower() == key:
                    return label
    return None


# ------------------------------------------------------------------ majority over k replies
def majority(replies: Sequence[str], labels: Sequence[str],
             rewards: Mapping[str, float] | None = None) -> Verdict:
    """The verdict of `replies` by plurality over the parsed ones; unparsed replies do not vote."""
    parsed = [parse_label(r, labels) for r in replies]
    votes = collections.Counter(p for p in parsed if p is not None)
    unparsed = sum(p is None for p in parsed)
    ordered = {l: votes[l] for l in labels if votes[l]}
    if not votes:
        return Verdict(None, tuple(replies), f"{FAILED_UNPARSED}: none of {len(replies)} replies gave a label",
                       ordered, unparsed)
    top = max(votes.values())
    winners = [l for l in labels if votes[l] == top]
    if len(winners) > 1:
        return Verdict(None, tuple(replies), f"{FAILED_TIE}: {' = '.join(winners)} with {top} votes each",
                       ordered, unparsed)
    label = winners[0]
    score = None if rewards is None else rewards.get(label)
    return Verdict(label, tuple(replies), None, ordered, unparsed, score)
