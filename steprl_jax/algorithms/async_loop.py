"""Asynchronous rollouts (`rl.asynchronous`): a rollout thread that keeps sampling and a learner that
keeps training, joined by a bounded queue of whole judged iterations (every tree or group of an
iteration complete, kept or dropped by the method's rules exactly as in the synchronous loop).

Versions. The policy the run starts (or resumes) with is version `start`; training on iteration
i's batch makes version i + 1. The rollout thread may start iteration i once version
i - k exists (k = `max_staleness`), so no batch is more than k versions behind the learner that
takes it, and generation waits rather than producing work that would be thrown away (AReaL's
capacity rule, verl's paused rollouter):
  * `in_flight=False` (default): iteration i samples with version max(start, i - k) exactly, set
    at its start. Which trees a run trains on does not depend on timing: runs are deterministic
    and a killed run resumes bit for bit.
  * `in_flight=True`: each new version goes to the sampler as soon as it is trained, also in the
    middle of an episode (between two decode calls of continuous batching, between two turns).
    Fresher data; which version samples which token depends on timing.
Every sampled token records its version (`Step.action_versions`). The learner measures each
tree's staleness as its version minus the oldest version among the tree's tokens and drops a
tree past k (counted: `stale_dropped`; it happens after resuming with a smaller k).

Off-policy correction (`is_cap` > 0): decoupled PPO (training/learner.py `behaviour_cap`): the
clip's reference is the learner's policy as the update starts (its log-probs recomputed), and
each token's loss is weighted by min(pi_prox / pi_behaviour, is_cap), pi_behaviour being the
sampler's recorded log-prob. An update's first step reads the proximal log-probs from its own
forward pass (its parameters are the proximal policy), so a one-minibatch update costs no extra
log-prob pass; later minibatches get them from one pass each before the first step. Of the
peers' choices (AReaL's decoupled loss, verl's rollout_is, Tunix's sampler_is: the same weight,
token level, detached, capped at 2 by default in the last two) this keeps the trust region around a policy the learner holds, whatever version sampled the
data, and on fresh data it is the plain surrogate (weights 1, first ratio 1).

Evaluation happens on the rollout thread, before the iteration it precedes, with the version the
synchronous loop would evaluate (it waits for it: an evaluation drains the pipeline).

Checkpoints. A save after iteration i waits until the rollout thread has finished what it may
produce before version i + 1 exists (iterations up to i + k) and saves those queued iterations
with the train state, in the same data position; a resumed run trains on them first and the
rollout thread goes on after them: nothing is lost or sampled twice.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Optional

import jax

from steprl_jax.agents.records import TreeRecord
from steprl_jax.errors import ConfigError
from steprl_jax.training.host_memory import trim_heap

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    max_staleness: int = 0
    in_flight: bool = False
    is_cap: float = 2.0

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0

    @property
    def behaviour_cap(self) -> Optional[float]:
        """The learner's off-policy correction cap: only where data may be stale."""
        return self.is_cap if self.enabled and self.is_cap > 0 else None

    @classmethod
    def from_config(cls, config) -> "AsyncSettings":
        a = config.rl.asynchronous
        out = cls(int(a.max_staleness), bool(a.in_flight), float(a.is_cap))
        if out.max_staleness < 0:
            raise ConfigError(f"config.rl.asynchronous.max_staleness must be >= 0, got {out.max_staleness}")
        if not out.is_cap >= 0:
            raise ConfigError(f"config.rl.asynchronous.is_cap must be >= 0 (0: no correction), got {out.is_cap}")
        if out.enabled and jax.process_count() > 1:
            raise ConfigError("config.rl.asynchronous.max_staleness > 0 runs on one process (its sampler and learner "
                              "may have their own devices: config.mesh); with several processes use 0")
        return out


def tree_version(tree: TreeRecord) -> Optional[int]:
    """The oldest policy version among the tree's sampled tokens (None where none is recorded)."""
    versions = [v for node in tree.nodes for v in (node.step.action_versions or ())]
    return min(versions) if versions else None


class _Stopped(Exception):
    """The other side has stopped (an error or the end): stop waiting."""


class _Published:
    """The learner's policy versions, awaited by the rollout thread. Keeps the models a
    deterministic (not in-flight) rollout still needs."""

    def __init__(self, start: int, model):
        self._cond = threading.Condition()
        self.latest, self._models = start, {start: model}
        self.waiting = False  # the rollout thread waits for a version not yet published
        self.stopped = False

    def publish(self, version: int, model, keep_from: int) -> None:
        with self._cond:
            self.latest = version
            if model is not None:
                self._models[version] = model
            for v in [v for v in self._models if v < keep_from and v != version]:
                del self._models[v]
            self._cond.notify_all()

    def wait(self, version: int):
        """The model of `version` (None if it was not kept) once it is published."""
        with self._cond:
            while self.latest < version and not self.stopped:
                self.waiting = True
                self._cond.notify_all()
                self._cond.wait()
            self.waiting = False
            if self.stopped:
                raise _Stopped
            return self._models.get(version)

    def wait_idle(self, producer_done: threading.Event) -> None:
        """Until the rollout thread waits for an unpublished version (or has finished)."""
        with self._cond:
            while not (self.waiting or producer_done.is_set() or self.stopped):
                self._cond.wait(timeout=0.5)

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


@dataclasses.dataclass
class _Produced:
    iteration: int
    result: object  # online.IterationResult


class AsyncRun:
    """`OnlineLoop.run` with asynchronous rollouts (`AsyncSettings.enabled`)."""

    def __init__(self, loop, settings: AsyncSettings):
        self.loop, self.settings = loop, settings

    # ------------------------------------------------------------------ the rollout thread
    def _produce(self, first: int, cursor: int, start: int, stop_at: int) -> None:
        """Iterations `first`.. (those from `start` were rolled out before a resume: only their
        evaluations are left), each put on the queue whole."""
        loop, k = self.loop, self.settings.max_staleness
        try:
            for it in range(start, stop_at):
                if it % loop.settings.eval_every == 0 and not loop.evaluated(it):
                    model = self._published.wait(it)  # in flight the sampler has it already
                    if model is not None:
                        loop.sampler.set_params(model, version=it)
                    loop.evaluate(it)
                if it < first:
                    continue
                version = max(start, it - k)
                model = self._published.wait(version)
                if not self.settings.in_flight:
                    loop.sampler.set_params(model, version=version)
                t0 = time.perf_counter()
                result = loop.collect(it, cursor)
                result.counts["produce_s"] += time.perf_counter() - t0
                cursor = result.cursor
                self._queue.put(_Produced(it, result))
        except _Stopped:
            pass
        except BaseException as error:  # the learner re-raises it
            self._error = error
            self._queue.put(None)
        finally:
            self._producer_done.set()

    # ------------------------------------------------------------------ the learner
    def run(self, start: int, cursor: int, queued: list) -> dict:
        """From the restored position (`OnlineLoop.restore_position`) to the end; the summary."""
        from steprl_jax.algorithms.online import IterationResult, batch_metrics

        loop, s = self.loop, self.loop.settings
        if start:
            loop.push_params(start)
        self._published = _Published(start, loop.learner.policy() if not self.settings.in_flight else None)
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._producer_done = threading.Event()
        self._backlog = backlog = collections.deque(_Produced(int(p["iteration"]), IterationResult.from_json(p))
                                                    for p in queued)
        self._cursor = cursor  # the query cursor after the last iteration the learner took
        first = start + len(backlog)
        producer = threading.Thread(target=self._produce, name="rollouts", daemon=True,
                                    args=(first, cursor, start, s.iterations))
        producer.start()
        summary, finished = {}, False
        bar = loop.progress_bar(start)
        try:
            for it in range(start, s.iterations):
                t0 = time.perf_counter()
                item = backlog.popleft() if backlog else self._queue.get()
                if item is None:
                    raise RuntimeError("the rollout thread failed") from self._error
                if item.iteration != it:
                    raise RuntimeError(f"rollouts of iteration {item.iteration} reached the learner at {it}")
                result = item.result
                kept, stale, oldest = self._fresh(result.kept, it)
                metrics = batch_metrics(result)
                metrics.update({"stale_dropped": float(stale), "staleness": float(it - oldest) if oldest is not None
                                else 0.0, "wait_s": time.perf_counter() - t0})
                metrics.update(loop.train(kept, it, push=False))
                trim_heap()
                self._cursor = result.cursor
                self._publish(it + 1)
                metrics["iteration_s"] = time.perf_counter() - t0
                loop.write_records(it, result.mine)
                loop.log_metrics(it + 1, metrics)
                if (it + 1) % s.save_every == 0 or it + 1 == s.iterations:
                    self._save(it + 1)
                self._release(it + 1)
                bar.update(1)
                bar.set_postfix({m: f"{metrics[m]:.3g}" for m in ("reward_mean", "loss") if m in metrics})
                summary = metrics
            finished = True
        finally:
            bar.close()
            self._published.stop()
            # after an error or an interrupt the thread may be mid-iteration: it dies with the process
            producer.join(timeout=None if finished else 1.0)
        loop.push_params(s.iterations)  # the final evaluation's policy
        return loop.finish(summary)

    def _fresh(self, trees, version: int):
        """(the trees at most k versions old, how many were dropped, the oldest version kept)."""
        kept, dropped, oldest = [], 0, None
        for tree in trees:
            v = tree_version(tree)
            if v is not None and version - v > self.settings.max_staleness:
                dropped += 1
                continue
            kept.append(tree)
            if v is not None:
                oldest = v if oldest is None else min(oldest, v)
        return kept, dropped, oldest

    def _publish(self, version: int) -> None:
        """The new version where the rollout thread finds it; in flight, straight to the sampler
        (the version stays unpublished to the rollout thread until `_release`, so a save sees it idle)."""
        self._pending = self.loop.learner.policy()
        if self.settings.in_flight:
            self.loop.sampler.set_params(self._pending, version=version)

    def _release(self, version: int) -> None:
        model = None if self.settings.in_flight else self._pending
        self._published.publish(version, model, keep_from=version - self.settings.max_staleness)
        self._pending = None

    def _save(self, version: int) -> None:
        """The train state with the iterations the rollout thread has finished and the learner has
        not taken: it may produce up to iteration version - 1 + k before `_release(version)`."""
        self._published.wait_idle(self._producer_done)
        if self._error is not None:
            raise RuntimeError("the rollout thread failed") from self._error
        produced = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                raise RuntimeError("the rollout thread failed") from self._error
            produced.append(item)
        for item in produced:  # back in order for the learner
            self._queue.put(item)
        ahead = list(self._backlog) + produced  # a resumed run's queued iterations come first
        cursor = ahead[-1].result.cursor if ahead else self._cursor
        self.loop.save(version, cursor, [dict(p.result.to_json(), iteration=p.iteration) for p in ahead])
