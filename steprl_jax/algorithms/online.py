"""The one on-policy loop (config.job = "rl"), the same for every method registered in algorithms/base.py.

    python -m steprl_jax.main --config=configs/portool_toolworld.py --config.algorithm=grpo

Per iteration (`algorithms/base.py` says what each method contributes):

    queries     the next `rl.queries_per_iteration` training queries (per-epoch permutations
                from the seed, read at a cursor: the same query may return, never collides)
    rollouts    the method's rollout schedule (agents/schedules): one tree per query; tools live
    judge       one batched outcome call for every leaf (true / false / unable_to_answer ->
                +1 / -1 / 0); a failed verdict drops its leaf from the batch (counted, kept
                in the records with the reason); a partly judged tree trains on the rest
    keep        the method's `keep` (dynamic sampling): dropped groups are replaced by more
                queries, up to the method's `sampling_rounds`
    build       the algorithm's batch builder -> packed rows, one advantage per step token
    train       ppo_epochs x minibatches train steps; old log-probs are the sampler's, so the
                first step has ratio 1 and clip fraction 0
    push        the sampler gets a copy of the new parameters (no recompilation; the train
                step donates its own buffers)
    log         metrics.jsonl and TensorBoard (`tb/rl/`); records in rollouts/iter_XXXXX.jsonl
    checkpoint  every `rl.save_every` iterations: train state (parameters, optimizer, step,
                its RNG) and the data position (iteration, query cursor, next rollout keys)
    eval        before the first iteration, every `rl.eval_every` and after the last: held-out
                queries (`rl.eval.num_tasks`, 0 switches it off), greedy by default, judge votes
                `rl.eval.votes`, the paper's four metrics with 95% intervals ->
                eval/iter_XXXXX.metrics.json

Every random draw of an iteration (the rollout key, the schedule's host RNG) is a pure function
of (seed, iteration, sampling round), so a resumed run continues bit-identically.

With `rl.asynchronous.max_staleness` K > 0 the same phases run on two threads: queries, rollouts,
judge and keep ahead of the learner, at most K policy versions behind it; build, train, push, log
and checkpoint on the learner (algorithms/async_loop.py).

The job (`run`, `build_loop`) reads the ConfigDict once into frozen settings; the loop below it
takes the settings, the learner (training/learner.py), the rollout engine and the judge.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from tqdm import tqdm

from steprl_jax.agents.records import TreeRecord
from steprl_jax.agents.schedules import Query, get_schedule
from steprl_jax.agents.tasks import build_suite, calls_base_model, rollout_config
from steprl_jax.agents.tree_batch import judged_tree
from steprl_jax.algorithms.async_loop import AsyncRun, AsyncSettings
from steprl_jax.algorithms.base import Algorithm, get_algorithm
from steprl_jax.algorithms.offline import (export_adapters, items_at, lora_fields, optimizer_config, remat_of)
from steprl_jax.algorithms.workdir import check_manifest
from steprl_jax.errors import ConfigError
from steprl_jax.evaluation.metrics import episode_terms
from steprl_jax.io import write_json_atomic, write_text_atomic
from steprl_jax.models.lora import LoraConfig
from steprl_jax.training import distributed
from steprl_jax.training.host_memory import trim_heap
from steprl_jax.training.learner import Learner, LearnerSettings
from steprl_jax.training.metrics_log import MetricsLog

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class OnlineSettings:
    algorithm: Algorithm
    method: Any  # the algorithm's own settings (`Algorithm.read`); `.rollout` is its schedule's
    learner: LearnerSettings
    iterations: int
    queries_per_iteration: int
    save_every: int
    eval_every: int
    seed: int
    workdir: str
    progress: bool = False
    export_adapters: bool = False
    async_rollouts: AsyncSettings = AsyncSettings()  # rl.asynchronous (algorithms/async_loop.py)


def read_settings(config) -> OnlineSettings:
    """The rl job's settings, checked before anything loads (ConfigError naming the field)."""
    algorithm = get_algorithm(config.algorithm)
    rl = config.rl
    for name in ("iterations", "queries_per_iteration", "ppo_epochs", "minibatches", "num_microbatches",
                 "save_every", "eval_every"):
        if int(rl[name]) < 1 and not (name == "iterations" and int(rl[name]) == 0):
            raise ConfigError(f"config.rl.{name} must be >= 1, got {rl[name]}")
    if int(config.rollout.tree.n) < 1:
        raise ConfigError(f"config.rollout.tree.n (trajectories per query) must be >= 1, got {config.rollout.tree.n}")
    if config.env.format not in algorithm.formats:
        raise ConfigError(f"config.env.format: {algorithm.name} trains on the {' or '.join(algorithm.formats)} "
                          f"format; got {config.env.format!r}")
    method = algorithm.read(config)
    async_rollouts = AsyncSettings.from_config(config)
    steps = int(rl.iterations) * int(rl.ppo_epochs) * int(rl.minibatches)
    learner = LearnerSettings(
        loss=algorithm.loss(method), optimizer=optimizer_config(config, steps),
        num_microbatches=int(rl.num_microbatches), max_microbatch_tokens=int(rl.max_microbatch_tokens),
        remat=remat_of(rl), ppo_epochs=int(rl.ppo_epochs), minibatches=int(rl.minibatches),
        min_rows=int(rl.queries_per_iteration), attention_length=float(rl.attention_length),
        skip_without_signal=bool(rl.skip_update_without_signal), lora=LoraConfig.from_config(config.get("lora")),
        behaviour_cap=async_rollouts.behaviour_cap)
    return OnlineSettings(algorithm, method, learner, iterations=int(rl.iterations),
                          queries_per_iteration=int(rl.queries_per_iteration), save_every=int(rl.save_every),
                          eval_every=int(rl.eval_every), seed=int(config.seed), workdir=str(config.workdir),
                          progress=bool(config.progress), export_adapters=export_adapters(config),
                          async_rollouts=async_rollouts)


def _path(workdir: str, *parts) -> str:
    return os.path.join(workdir, *parts)


def iteration_seed(seed: int, iteration: int, round_: int = 0) -> int:
    """The integer seed of an iteration's host RNGs (tree resampling, ARPO branching, ...)."""
    return int(np.random.SeedSequence([seed, iteration, round_]).generate_state(1)[0])


def rollout_key(seed: int, iteration: int, round_: int = 0):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), iteration), round_)


# ----------------------------------------------------------------------------- the job
def run(config, model_and_tokenizer=None) -> dict:
    """Warm start (SFT on expert demonstrations, once), then the online loop; returns a summary.
    `model_and_tokenizer` skips loading `config.model.source` (tests, notebooks)."""
    settings = read_settings(config)
    os.makedirs(config.workdir, exist_ok=True)
    check_manifest(config.workdir, {
        "job": "rl", "algorithm": settings.algorithm.name, "model.source": config.model.source,
        "task.name": config.task.name, "task.num_tasks": int(config.task.num_tasks),
        "task.offset": int(config.task.offset), "task.seed": int(config.task.get("seed", 0)), "seed": int(config.seed),
        "n": int(config.rollout.tree.n),
        "rollout.max_steps": int(config.rollout.max_steps), "warm_start.source": config.rl.warm_start.source,
        "warm_start.updates": int(config.rl.warm_start.updates), **lora_fields(config)})
    # With config.mesh the policy loads straight onto the trainer's mesh (training/distributed.py).
    base, tokenizer = model_and_tokenizer or distributed.load_policy(config)
    model, source = warm_start(config, base, tokenizer)
    loop = build_loop(config, model, tokenizer, base_source=source, base_model=base)
    del model, base  # the loop keeps what it needs
    try:
        return loop.run()
    finally:
        loop.close()


def warm_start(config, model, tokenizer):
    """(policy, its load_pretrained source) to start RL from: `rl.warm_start.source` if set; else
    SFT for `rl.warm_start.updates` updates on the task suite's expert demonstrations (exported to
    policy/sft, reused when present); else the model itself."""
    w = config.rl.warm_start
    if w.source:
        return distributed.load_policy(config, w.source)[0], w.source
    if int(w.updates) <= 0:
        return model, config.model.source
    out = _path(config.workdir, "policy", "sft")
    if not os.path.isdir(out):
        from steprl_jax.algorithms import sft as sft_lib
        from steprl_jax.algorithms.offline import OfflineSpec, train_offline
        from steprl_jax.training.pack import share_prefix

        rows = sft_lib.expert_rows(config, tokenizer, split="train", local_model=(model, tokenizer))
        # One system prompt and tool list for every query: computed once per packed row.
        build = lambda items, update, policy: (share_prefix(list(items), int(w.max_row_tokens) or None), {})
        learner = LearnerSettings(sft_lib.LOSS, optimizer_config(config, int(w.updates), float(w.learning_rate)),
                                  num_microbatches=int(w.num_microbatches),
                                  max_microbatch_tokens=int(w.max_microbatch_tokens), remat=remat_of(w),
                                  attention_length=float(config.rl.attention_length),
                                  lora=LoraConfig.from_config(config.get("lora")))
        spec = OfflineSpec("sft", rows, build, learner, batch_size=int(w.batch_size), updates=int(w.updates),
                           save_every=int(w.save_every))
        trained = train_offline(spec, model, workdir=config.workdir, seed=int(config.seed),
                                progress=bool(config.progress), base_source=config.model.source,
                                mesh=distributed.MeshSpec.from_config(config.get("mesh")))
        trained.export(tokenizer, out, adapters=export_adapters(config), base_source=config.model.source)
    return distributed.load_policy(config, out)[0], out


def build_loop(config, model, tokenizer, base_source: Optional[str] = None, base_model=None) -> "OnlineLoop":
    """The loop of `config` around `model` (copied: the learner trains its own; each process samples
    on its own devices, the parameters moved there by the bridge, training/distributed.py).
    `base_model`: the model before any warm start, for an environment that calls it frozen
    (`agents.tasks.calls_base_model`; default `model`)."""
    from steprl_jax.agents.rollout import RolloutEngine
    from steprl_jax.judges.judging import Judging
    from steprl_jax.sampling import Sampler

    settings = read_settings(config)
    mesh = distributed.MeshSpec.from_config(config.get("mesh"))
    learner = Learner(model, settings.learner, seed=settings.seed, mesh=mesh, base_source=base_source,
                      checkpoint_dir=_path(settings.workdir, "checkpoints", "rl"))
    # The initial policy where this process samples: the sampler's first parameters, the local
    # judge's model (here and in evaluation), the flow format's frozen modules; `model` itself
    # without a mesh. Training never writes to it.
    policy = distributed.sampling_copy(model, learner.bridge)
    base = policy
    if base_model is not None and base_model is not model and calls_base_model(config):
        base = distributed.sampling_copy(base_model, learner.bridge)
    suite = build_suite(config, split="train", local_model=(base, tokenizer))
    judging = Judging.from_config(config, outcome_rule=suite.outcome_rule, local_model=(policy, tokenizer))
    sampler = Sampler(policy, tokenizer, max_context=int(config.rollout.max_context),
                      mesh=distributed.sampler_mesh(mesh))
    engine = RolloutEngine(sampler, tokenizer, suite.env, dataclasses.replace(rollout_config(config), with_entropy=True),
                           seed=settings.seed)
    return OnlineLoop(settings, learner=learner, engine=engine, judging=judging, tasks=suite.tasks,
                      evaluate=held_out_evaluation(config, policy, tokenizer, sampler, base), tokenizer=tokenizer,
                      base_source=base_source)


def held_out_evaluation(config, policy, tokenizer, sampler, base_model=None) -> Optional[Callable]:
    """(out_dir, name) -> metrics: the held-out evaluation of the sampler's current parameters
    (`rl.eval`: greedy by default, its own vote count); None when switched off or not this process's.
    `base_model`: as `evaluation.runner.evaluate` takes it."""
    e = config.rl.eval
    if int(e.num_tasks) <= 0 or not distributed.is_primary():  # off; or process 0 evaluates
        return None
    from steprl_jax.evaluation.runner import evaluate

    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.rollout.temperature = float(e.temperature)
        config.rollout.episodes_per_task = int(e.episodes_per_task)
        config.rollout.tree.enabled = False
        config.judge.outcome.votes = int(e.votes)
        config.task.eval_num_tasks = int(e.num_tasks)
        config.progress = False
    return lambda out_dir, name: evaluate(config, (policy, tokenizer), split="test", out_dir=out_dir, name=name,
                                          sampler=sampler, plot=False, base_model=base_model)


@dataclasses.dataclass
class IterationResult:
    trees: list  # every rollout record of the iteration (judged, with verdicts), of every process
    kept: list  # judged trees the batch is built from
    cursor: int
    counts: collections.Counter
    mine: list = dataclasses.field(default_factory=list)  # the trees this process rolled out

    def to_json(self) -> dict:
        """For a checkpoint of asynchronous rollouts (one process: `mine` is `trees`)."""
        return {"trees": [t.to_json() for t in self.trees], "kept": [t.to_json() for t in self.kept],
                "cursor": self.cursor, "counts": dict(self.counts)}

    @classmethod
    def from_json(cls, data: dict) -> "IterationResult":
        trees = [TreeRecord.from_json(t) for t in data["trees"]]
        return cls(trees, [TreeRecord.from_json(t) for t in data["kept"]], int(data["cursor"]),
                   collections.Counter(data["counts"]), mine=trees)


class OnlineLoop:
    def __init__(self, settings: OnlineSettings, *, learner: Learner, engine, judging, tasks: Sequence,
                 evaluate: Optional[Callable] = None, tokenizer=None, base_source: Optional[str] = None):
        self.settings, self.algorithm, self.method = settings, settings.algorithm, settings.method
        self.learner, self.engine, self.sampler, self.judging = learner, engine, engine.sampler, judging
        self.schedule = get_schedule(self.algorithm.schedule)
        self.tasks = list(tasks)
        self.task_by_id = {t.id: t for t in self.tasks}
        self._evaluate, self.tokenizer = evaluate, tokenizer
        self.base_source = base_source  # where the initial policy loads from: the base of exported LoRA adapters
        self.seed, self.workdir = settings.seed, settings.workdir
        self.metrics_log = MetricsLog(self.workdir, "rl") if distributed.is_primary() else None

    def close(self) -> None:
        self.engine.close()
        close_env = getattr(self.engine.env, "close", None)  # an env with models or pools of its own
        if close_env is not None:
            close_env()
        if self.metrics_log is not None:
            self.metrics_log.close()
        self.learner.close()

    # ------------------------------------------------------------------ resume
    def restore_position(self) -> tuple[int, int, list]:
        """(iteration, query cursor, queued iterations) of the latest checkpoint; (0, 0, []) when
        there is none. Queued: iterations rolled out ahead of the learner (asynchronous rollouts,
        `IterationResult.to_json` with their iteration), the cursor then the one after them."""
        position = self.learner.restore()
        if position is None:
            return 0, 0, []
        start, cursor = int(position["iteration"]), int(position["cursor"])
        if position.get("next_rollout_key") != _key_list(rollout_key(self.seed, start)):
            raise ValueError(f"{self.learner.ckpt.directory}: the checkpoint's rollout key does not follow from "
                             f"seed {self.seed} (was the seed changed?)")
        queued = list(position.get("queued", []))
        log.info("rl: resumed at iteration %d (step %d)%s", start, self.learner.step,
                 f", {len(queued)} iterations rolled out ahead" if queued else "")
        return start, cursor, queued

    def save(self, iteration: int, cursor: int, queued: Sequence[dict] = ()) -> None:
        position = {"iteration": iteration, "cursor": cursor,
                    "next_rollout_key": _key_list(rollout_key(self.seed, iteration)),
                    "next_tree_seed": iteration_seed(self.seed, iteration)}
        if queued:
            position["queued"] = list(queued)
        self.learner.save(iteration, position)

    def push_params(self, version: int) -> None:
        """The learner's policy to the sampler, as policy `version` (the iterations trained)."""
        self.sampler.set_params(self.learner.policy(), version=version)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        """The synchronous loop; asynchronous rollouts (`rl.asynchronous`) run `async_loop.AsyncRun`,
        which also takes a checkpoint that holds iterations rolled out ahead."""
        s = self.settings
        start, cursor, queued = self.restore_position()
        if s.async_rollouts.enabled or queued:
            return AsyncRun(self, s.async_rollouts).run(start, cursor, queued)
        if start:
            self.push_params(start)
        bar = self.progress_bar(start)
        summary = {}
        try:
            for it in range(start, s.iterations):
                if it % s.eval_every == 0:
                    self.evaluate(it)
                    trim_heap()
                t0 = time.perf_counter()
                result = self.collect(it, cursor)
                cursor = result.cursor
                trim_heap()  # each phase's freed buffers back to the system (training/host_memory.py)
                metrics = batch_metrics(result)
                metrics.update(self.train(result.kept, it))
                trim_heap()
                metrics["iteration_s"] = time.perf_counter() - t0
                self.write_records(it, result.mine)
                self.log_metrics(it + 1, metrics)
                if (it + 1) % s.save_every == 0 or it + 1 == s.iterations:
                    self.save(it + 1, cursor)
                bar.update(1)
                bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward_mean", "loss") if k in metrics})
                summary = metrics
        finally:
            bar.close()
        return self.finish(summary)

    def progress_bar(self, start: int):
        s = self.settings
        return tqdm(total=s.iterations, initial=start, desc=f"rl/{self.algorithm.name}",
                    disable=not s.progress or not distributed.is_primary())

    def log_metrics(self, step: int, metrics: dict) -> None:
        if self.metrics_log is not None:
            self.metrics_log.write(step, metrics)

    def finish(self, summary: dict) -> dict:
        """The final evaluation, the exported policy and summary.json."""
        s = self.settings
        final = self.evaluate(s.iterations)
        self.learner.export(self.tokenizer, _path(self.workdir, "policy", "rl"), adapters=s.export_adapters,
                            base_source=self.base_source)
        out = {"algorithm": self.algorithm.name, "iterations": s.iterations, "last_iteration": summary,
               "eval": {k: final.get("ci", {}).get(k) for k in ("accuracy", "tool_steps", "unanswerable",
                                                               "format_reward")}}
        if distributed.is_primary():
            write_json_atomic(_path(self.workdir, "summary.json"), out)
        return out

    # ------------------------------------------------------------------ rollouts + judge
    def collect(self, iteration: int, cursor: int) -> IterationResult:
        """Roll out and judge the iteration's queries; with the method's `keep`, more rounds until
        `queries_per_iteration` groups are kept or its sampling rounds run out."""
        want = self.settings.queries_per_iteration
        keep = self.algorithm.keep
        rounds = self.algorithm.sampling_rounds(self.method) if keep is not None else 1
        counts = collections.Counter()
        trees, kept, mine = [], [], []
        for round_ in range(rounds):
            need = want - len(kept)
            if need <= 0:
                break
            tasks = items_at(self.tasks, cursor, need, self.seed)
            cursor += need
            t0, before = time.perf_counter(), self.engine.stats.to_json()
            local = self.rollout(tasks, iteration, round_)  # this process's share, judged here
            t1 = time.perf_counter()
            self.judge(local)
            counts["rollout_s"] += t1 - t0
            for name, value in self.engine.stats.to_json().items():  # where the rollout's time went
                if name.endswith("_s"):
                    counts[f"rollout_{name}"] += value - before[name]
            counts["judge_s"] += time.perf_counter() - t1
            counts["sampling_rounds"] += 1
            mine += local
            batch = self._gather(local)
            for tree in batch:
                trees.append(tree)
                judged = judged_tree(tree)
                leaves = len(tree.leaves())
                counts["leaves"] += leaves
                counts["judge_failed"] += leaves - (len(judged.leaves()) if judged else 0)
                if judged is None:
                    counts["trees_unjudged"] += 1
                elif keep is not None and not keep(judged, self.method):
                    counts["groups_dropped"] += 1
                elif len(kept) < want:
                    kept.append(judged)
        return IterationResult(trees, kept, cursor, counts, mine)

    def _gather(self, local: list[TreeRecord]) -> list[TreeRecord]:
        """Every process's judged trees, in query order (the same list on every process)."""
        if jax.process_count() == 1:
            return local
        shares = distributed.allgather_json([t.to_json() for t in local])
        trees = [TreeRecord.from_json(t) for share in shares for t in share]
        return sorted(trees, key=lambda t: int(t.id.rsplit("/q", 1)[1]))

    def rollout(self, tasks: Sequence, iteration: int, round_: int) -> list[TreeRecord]:
        """This process's share of `tasks` (queries p, p + P, ...; all of them with one process),
        one tree per query by the method's schedule. A schedule whose episodes sample with their
        global index samples on a share what one process would; the others draw from one stream
        in their order, so each process gets its own."""
        queries = [Query(f"it{iteration:05d}/r{round_}/q{j}", task, j) for j, task in distributed.share(tasks)]
        key, seed = rollout_key(self.seed, iteration, round_), iteration_seed(self.seed, iteration, round_)
        if jax.process_count() > 1 and not self.schedule.per_episode_keys:
            key, seed = jax.random.fold_in(key, jax.process_index()), seed + jax.process_index()
        return self.schedule.run(self.engine, queries, self.method.rollout, key, seed)

    def judge(self, trees: Sequence[TreeRecord]) -> None:
        """Outcome verdicts of every leaf of `trees` in one batched call (model judges run
        concurrently): R_out in `leaf_outcomes` (None when the judge failed), `leaf_verdicts`."""
        pairs = []
        for tree in trees:
            task = self.task_by_id.get(tree.query_id)
            if task is None:
                raise ValueError(f"tree {tree.id}: query {tree.query_id} is not in the training tasks")
            pairs.append((task, tree))
        self.judging.judge_trees(pairs)

    # ------------------------------------------------------------------ train
    def train(self, kept: Sequence[TreeRecord], iteration: int = 0, push: bool = True) -> dict:
        """Build the method's batch from `kept` and update the learner; `push`: the new policy to the
        sampler (as version iteration + 1)."""
        if not kept:
            log.warning("rl: no judged tree to train on this iteration (judge failures or all groups dropped)")
            return {"skipped": 1.0}
        t0 = time.perf_counter()
        rows, metrics = self.algorithm.build(list(kept), self.method)
        metrics["build_s"] = time.perf_counter() - t0
        if not rows:
            return {**metrics, "skipped": 1.0}
        metrics.update(self.learner.update(rows, where=f"rl iteration {iteration + 1}"))
        if push:
            self.push_params(iteration + 1)
        return metrics

    # ------------------------------------------------------------------ records + eval
    def write_records(self, iteration: int, trees: Sequence[TreeRecord]) -> None:
        """This process's rollouts of the iteration (one file per process with several)."""
        text = "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in trees)
        name = f"iter_{iteration:05d}" + (f".process{jax.process_index()}" if jax.process_count() > 1 else "")
        write_text_atomic(_path(self.workdir, "rollouts", f"{name}.jsonl"), text)

    def _eval_path(self, iteration: int) -> tuple[str, str, str]:
        out_dir, name = _path(self.workdir, "eval"), f"iter_{iteration:05d}."
        return out_dir, name, os.path.join(out_dir, f"{name}metrics.json")

    def evaluated(self, iteration: int) -> bool:
        """Whether the held-out evaluation at `iteration` is done (or switched off)."""
        return self._evaluate is None or os.path.exists(self._eval_path(iteration)[2])

    def evaluate(self, iteration: int) -> dict:
        """Held-out evaluation of the current policy (the sampler's parameters), once per iteration."""
        out_dir, name, path = self._eval_path(iteration)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        if self._evaluate is None:
            return {}
        t0 = time.perf_counter()
        metrics = self._evaluate(out_dir, name)
        log.info("rl: eval at iteration %d in %.1f s: accuracy %.3f", iteration, time.perf_counter() - t0,
                 metrics["ci"]["accuracy"]["value"])
        return metrics


def _key_list(key) -> list:
    return [int(x) for x in np.asarray(key)]  # a raw uint32 PRNGKey


def batch_metrics(result: IterationResult) -> dict:
    """The iteration's batch: mean R_out, accuracy and the paper's metrics over the judged
    trajectories, the sampled-token entropy, counts and where the time went."""
    trajectories = []
    for tree in result.trees:
        for leaf in tree.leaves():
            if tree.leaf_outcomes.get(str(leaf)) is not None:
                t = tree.trajectory(leaf)
                t.judgements = {"outcome": tree.leaf_verdicts[str(leaf)]}
                trajectories.append(t)
    out = {k: float(v) for k, v in result.counts.items()}
    if trajectories:
        terms = [episode_terms(t) for t in trajectories]
        for name in ("accuracy", "tool_steps", "unanswerable", "format_reward"):
            den = sum(x[name][1] for x in terms)
            out[name] = sum(x[name][0] for x in terms) / den if den else 0.0
        out["reward_mean"] = float(np.mean([t.judgements["outcome"]["score"] for t in trajectories]))
    entropies = [e for tree in result.trees for node in tree.nodes for e in (node.step.action_entropies or [])]
    if entropies:
        out["entropy"] = float(np.mean(entropies))
    generated = sum(len(node.step.action_ids) for tree in result.trees for node in tree.nodes)
    out["generated_tokens"] = float(generated)
    if result.counts.get("rollout_s"):
        out["tokens_per_s"] = generated / result.counts["rollout_s"]
    out["queries_kept"] = float(len(result.kept))
    return out
