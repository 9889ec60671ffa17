"""Model judges: a prompt, a backend, `k` replies, and their majority.

    judge = ProcessJudge(backend, votes=3)
    verdicts = judge.judge([StepItem(question, history, action), ...])   # one Verdict per item, in order

Items are judged concurrently on a thread pool, so a batch never waits on one slow call at a time;
each item's `k` replies come from one `chat(..., n=k)` call. A backend failure becomes a failed
verdict with its reason (the batch goes on); unreadable replies are counted, never guessed.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Any, Sequence

from steprl_jax.judges import prompts
from steprl_jax.judges.backends import BackendError, ChatBackend
from steprl_jax.judges.items import OutcomeItem, StepItem, TrajectoryItem
from steprl_jax.judges.verdicts import (FAILED_BACKEND, OUTCOME_LABELS, OUTCOME_REWARDS, PROCESS_LABELS,
                                        PROCESS_REWARDS, TRAJECTORY_LABELS, TRAJECTORY_REWARDS, Verdict,
                                        failed_verdict, majority)

log = logging.getLogger(__name__)


class JudgeStats:
    """Thread-safe counters a run reports as metrics: verdicts, failures by code, unparsed replies."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()

    def record(self, verdict: Verdict) -> None:
        with self._lock:
            self._counts["verdicts"] += 1
            self._counts["unparsed_replies"] += verdict.unparsed
            self._counts["replies"] += len(verdict.raw)
            if verdict.ok:
                self._counts[f"label/{verdict.label}"] += 1
            else:
                self._counts["failed"] += 1
                self._counts[f"failed/{verdict.failure_code}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ModelJudge:
    """The shared machinery; subclasses name their labels, rewards and prompt."""

    labels: tuple[str, ...] = ()
    rewards: dict[str, float] = {}

    def __init__(self, backend: ChatBackend, votes: int = 1, temperature: float | None = None,
                 max_tokens: int = 512, max_workers: int = 16, max_context_chars: int | None = None):
        if votes < 1:
            raise ValueError(f"votes must be >= 1, got {votes}")
        self.backend = backend
        self.votes = votes
        # One vote is a point estimate: decode greedily. Several votes need diversity to mean anything.
        self.temperature = (0.0 if votes == 1 else 1.0) if temperature is None else float(temperature)
        self.max_tokens = max_tokens
        self.max_workers = max_workers
        self.max_context_chars = max_context_chars
        self.stats = JudgeStats()

    def messages(self, item: Any) -> list[dict]:
        raise NotImplementedError

    def judge_one(self, item: Any) -> Verdict:
        try:
            replies = self.backend.chat(self.messages(item), self.votes, self.temperature, self.max_tokens)
            verdict = majority(replies, self.labels, self.rewards)
        except BackendError as error:
            verdict = failed_verdict(f"{FAILED_BACKEND}: {error}")
        except Exception as error:  # a judge must not stop the run; the reason is kept and logged
            log.exception("judge backend raised")
            verdict = failed_verdict(f"{FAILED_BACKEND}: {type(error).__name__}: {error}")
        self.stats.record(verdict)
        return verdict

    def judge(self, items: Sequence[Any]) -> list[Verdict]:
        """One verdict per item, in order; items are judged concurrently."""
        items = list(items)
        if len(items) <= 1 or self.max_workers <= 1:
            return [self.judge_one(item) for item in items]
        with concurrent.futures.ThreadPoolExecutor(min(self.max_workers, len(items)),
                                                   thread_name_prefix="judge") as pool:
            return list(pool.map(self.judge_one, items))


class ProcessJudge(ModelJudge):
    """SWiRL's process judge: GOOD/BAD for one step given the question and what came before."""

    labels = PROCESS_LABELS
    rewards = PROCESS_REWARDS

    def messages(self, item: StepItem) -> list[dict]:
        return prompts.process_messages(item.question, item.history, item.action, self.max_context_chars)

    def judge_steps(self, items: Sequence[StepItem]) -> list[Verdict]:
        return self.judge(items)


class OutcomeJudge(ModelJudge):
    """YES/NO: does the predicted answer match the answer key."""

    labels = OUTCOME_LABELS
    rewards = OUTCOME_REWARDS

    def messages(self, item: OutcomeItem) -> list[dict]:
        return prompts.outcome_messages(item.question, item.predicted, item.answer_key)


class TrajectoryVerdictJudge(ModelJudge):
    """PORTool's judge: true / false / unable_to_answer from the whole trajectory (R_out = +1/-1/0)."""

    labels = TRAJECTORY_LABELS
    rewards = TRAJECTORY_REWARDS

    def messages(self, item: TrajectoryItem) -> list[dict]:
        return prompts.trajectory_messages(item.question, item.trajectory, item.reference,
                                           self.max_context_chars)
