"""The evaluation run behind the main job: rollouts -> judges -> records -> metrics and a plot.

Resumable: every finished episode (or tree) is appended, judged, to `trajectories.jsonl`;
a restarted run reads that file, skips what is done and appends the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import jax
from tqdm import tqdm

from steprl_jax.agents.records import RecordStore, Trajectory, TreeRecord
from steprl_jax.agents.rollout import RolloutEngine
from steprl_jax.agents.schedules import Query, get_schedule
from steprl_jax.agents.tasks import build_suite, rollout_config
from steprl_jax.evaluation.metrics import ci_metrics, summary_plot, trajectory_metrics
from steprl_jax.io import write_json_atomic
from steprl_jax.judges.judging import Judging

log = logging.getLogger(__name__)


def evaluate(config, model_and_tokenizer=None, *, split: Optional[str] = None, out_dir: Optional[str] = None,
             name: str = "", sampler=None, plot: bool = True, base_model=None) -> dict:
    """Run the configured evaluation; returns its metrics.

    `model_and_tokenizer` skips loading `config.model.source` (its model where this process samples:
    `distributed.sampling_copy` of a policy on the trainer's mesh); `split` picks the task split
    (`agents.tasks.split_config`); records, metrics and the plot go to `out_dir` (default the
    workdir) as `{name}trajectories.jsonl`, `{name}metrics.json`, `{name}summary.png`; `sampler`
    reuses a sampler (e.g. one that already holds a trained policy's parameters); `base_model`: the
    model an environment calls frozen (`agents.tasks.calls_base_model`), default the evaluated one
    (a standalone evaluation of a trained flow planner: serve the base model and use
    `rl.flow_grpo.frozen.kind=http`)."""
    from steprl_jax.sampling import Sampler
    from steprl_jax.training import distributed

    out_dir = out_dir or config.workdir
    os.makedirs(out_dir, exist_ok=True)
    if model_and_tokenizer is None:
        # with config.mesh: straight onto this process's sampling devices (config.mesh.sampler)
        model_and_tokenizer = distributed.load_policy(config, sampling=True)
    model, tokenizer = model_and_tokenizer
    suite = build_suite(config, split=split, local_model=(model if base_model is None else base_model, tokenizer))
    if sampler is None:
        sampler = Sampler(model, tokenizer, max_context=int(config.rollout.max_context))
    engine = RolloutEngine(sampler, tokenizer, suite.env, rollout_config(config), seed=int(config.seed))
    judging = Judging.from_config(config, outcome_rule=suite.outcome_rule, local_model=(model, tokenizer),
                                  solution_reference=suite.solution_reference)
    store = RecordStore(os.path.join(out_dir, f"{name}trajectories.jsonl"))
    done = store.done_ids()
    tasks_by_id = {t.id: t for t in suite.tasks}
    started = time.perf_counter()
    try:
        tree_schedule = _tree_schedule(config, suite.env)
        if tree_schedule is not None:  # records are trees, stored a batch of trees at a time
            schedule, settings = tree_schedule
            todo = [Query(f"{t.id}#{schedule.name}", t) for t in suite.tasks if f"{t.id}#{schedule.name}" not in done]
            bar = tqdm(total=len(todo), desc=f"{name}{schedule.name}s", disable=not config.progress)
            per_call = max(1, int(config.rollout.batch_size) // settings.n)
            engine.key = jax.random.PRNGKey(int(config.seed))
            for start in range(0, len(todo), per_call):
                records = schedule.run(engine, todo[start:start + per_call], settings, None, int(config.seed) + start)
                for record in judging.judge_trees([(tasks_by_id[r.query_id], r) for r in records]):
                    store.append(record)
                bar.update(len(records))
        else:
            episodes = [(f"{t.id}#{e}", t) for t in suite.tasks for e in range(int(config.rollout.episodes_per_task))]
            # in waves that resume whole: a resumed run samples what it would have, token for token
            todo = [episode for episode in episodes if episode[0] not in done]
            bar = tqdm(total=len(todo), desc=f"{name}episodes", disable=not config.progress)
            size, batch = int(config.rollout.batch_size), []

            def judge_and_store(batch):  # a batch at once: model judges run concurrently
                for trajectory in judging.judge([(tasks_by_id[t.query_id], t) for t in batch]):
                    store.append(trajectory)
                bar.update(len(batch))

            for trajectory in engine.run_in_waves(episodes, done):
                batch.append(trajectory)
                if len(batch) == size:
                    judge_and_store(batch)
                    batch = []
            if batch:
                judge_and_store(batch)
        bar.close()
    finally:
        engine.close()
    wall_s = time.perf_counter() - started

    records = sorted(store.load(), key=lambda r: r.id)  # episodes are stored as they end: timing order
    trajectories = [r for r in records if isinstance(r, Trajectory)]
    for record in records:
        if isinstance(record, TreeRecord):
            for leaf in record.leaves():
                traj = record.trajectory(leaf)
                verdict = record.leaf_verdicts.get(str(leaf), {})
                traj.judgements = {"outcome": verdict, "process": []}
                trajectories.append(traj)
    metrics = trajectory_metrics(trajectories)
    metrics["ci"] = ci_metrics(trajectories, seed=int(config.seed))
    stats = engine.stats
    metrics.update({
        "task": config.task.name, "model": config.model.source, "wall_s_this_run": wall_s,
        "tokens_per_s": stats.generated_tokens / stats.generate_s if stats.generate_s else None,
        "time_s": {"generate": stats.generate_s, "prefill": stats.prefill_s, "append": stats.append_s,
                   "tool_wait": stats.tool_wait_s},
        "rollout_stats": stats.to_json(),
    })
    write_json_atomic(os.path.join(out_dir, f"{name}metrics.json"), metrics)
    if plot:
        summary_plot(metrics, trajectories, os.path.join(out_dir, f"{name}summary.png"),
                     title=f"{config.task.name} / {config.model.source}")
    return metrics


def _tree_schedule(config, env):
    """(schedule, settings) where an evaluated query is one tree record, else None (episodes):
    PORTool's trees (`rollout.tree.enabled`, the `tree` schedule), or the schedule an environment
    names as the only one that runs it (`env.schedule`: AgentFlow's system, `flow`), with
    `rollout.episodes_per_task` rollouts a query as the tree's leaves."""
    if config.rollout.tree.enabled:
        schedule = get_schedule("tree")
        return schedule, schedule.settings.from_config(config)
    name = getattr(env, "schedule", None)
    if name is None:
        return None
    schedule = get_schedule(name)
    settings = schedule.settings.from_config(config)
    return schedule, dataclasses.replace(settings, n=int(config.rollout.episodes_per_task))
