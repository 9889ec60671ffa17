"""The evaluation run behind the main job: rollouts -> judges -> records -> metrics and a plot.

Resumable: every finished episode (or tree) is appended, judged, to `trajectories.jsonl`;
a restarted run reads that file, skips what is done and appends the rest.
"""
from __future__ import annotations

import logging
import os
import time

from tqdm import tqdm

from steprl_jax.agents.records import RecordStore, Trajectory, TreeRecord
from steprl_jax.agents.rollout import RolloutConfig, RolloutEngine
from steprl_jax.evaluation.metrics import summary_plot, trajectory_metrics, write_json_atomic
from steprl_jax.evaluation.tasks import build_suite, process_rule
from steprl_jax.judges import rules

log = logging.getLogger(__name__)

# YES/NO of the model outcome judge read as PORTool's verdicts.
_YES_NO = {"YES": rules.TRUE, "NO": rules.FALSE}


class Judging:
    """Outcome and process verdicts for finished trajectories, by rule or by a model judge."""

    def __init__(self, config, suite, local_model=None):
        self.suite = suite
        self.outcome_cfg = config.judge.outcome
        self.process_cfg = config.judge.process
        self.tree_format = suite.env.format == "tool_call"
        self._outcome_judge = self._model_judge(config, self.outcome_cfg, "outcome", local_model)
        self._process_judge = self._model_judge(config, self.process_cfg, "process", local_model)

    @staticmethod
    def _model_judge(config, cfg, role, local_model):
        if cfg.kind == "rule":
            return None
        from steprl_jax.judges import build_backend
        from steprl_jax.judges.model_judges import OutcomeJudge, ProcessJudge, TrajectoryVerdictJudge

        backend = build_backend(dict(cfg), cache_dir=config.judge.cache_dir or os.path.join(config.workdir, "judge_cache"),
                                local_model=local_model)
        if role == "process":
            return ProcessJudge(backend, votes=int(cfg.votes))
        if config.env.format == "tool_call":
            return TrajectoryVerdictJudge(backend, votes=int(cfg.votes))
        return OutcomeJudge(backend, votes=int(cfg.votes))

    def outcome(self, task, trajectory: Trajectory) -> dict:
        if self._outcome_judge is None:
            label = self.suite.outcome_rule(task, trajectory)
            return {"label": label, "score": rules.OUTCOME_REWARD[label], "judge": "rule"}
        from steprl_jax.judges.items import outcome_item, trajectory_item

        if self.tree_format:
            verdict = self._outcome_judge.judge_one(trajectory_item(trajectory))
            label = verdict.label
        else:
            verdict = self._outcome_judge.judge_one(outcome_item(trajectory))
            label = _YES_NO.get(verdict.label)
        return {**verdict.to_json(), "label": label or "failed",
                "score": rules.OUTCOME_REWARD.get(label), "judge": self.outcome_cfg.kind}

    def process(self, task, trajectory: Trajectory) -> list[dict]:
        if self.tree_format and self._process_judge is None:
            return []  # the rule process judge is defined for SWiRL's tag actions
        if self._process_judge is None:
            return [{"label": v.verdict, "reasons": list(v.reasons), "judge": "rule"}
                    for v in (process_rule(task, trajectory, i) for i in range(len(trajectory.steps)))]
        from steprl_jax.judges.items import step_items

        return [{**v.to_json(), "label": v.label or "failed", "judge": self.process_cfg.kind}
                for v in self._process_judge.judge(step_items(trajectory))]

    def judge_trajectory(self, task, trajectory: Trajectory) -> Trajectory:
        trajectory.judgements = {"outcome": self.outcome(task, trajectory),
                                 "process": self.process(task, trajectory)}
        return trajectory

    def judge_tree(self, task, tree: TreeRecord) -> TreeRecord:
        for leaf in tree.leaves():
            verdict = self.outcome(task, tree.trajectory(leaf))
            tree.leaf_outcomes[str(leaf)] = verdict["score"]
            tree.metadata.setdefault("leaf_verdicts", {})[str(leaf)] = verdict
        return tree


def rollout_config(config) -> RolloutConfig:
    r = config.rollout
    return RolloutConfig(max_steps=int(r.max_steps), max_new_tokens=int(r.max_new_tokens),
                         max_context=int(r.max_context), temperature=float(r.temperature), top_k=int(r.top_k),
                         top_p=float(r.top_p), batch_size=int(r.batch_size), tool_workers=int(r.tool_workers))


def evaluate(config, model_and_tokenizer=None) -> dict:
    """Run the configured evaluation; `model_and_tokenizer` skips loading `config.model.source`."""
    from steprl_jax.models import load_pretrained
    from steprl_jax.sampling import Sampler

    os.makedirs(config.workdir, exist_ok=True)
    suite = build_suite(config)
    if model_and_tokenizer is None:
        model_and_tokenizer = load_pretrained(config.model.source, compute_dtype=config.model.compute_dtype)
    model, tokenizer = model_and_tokenizer
    sampler = Sampler(model, tokenizer, max_context=int(config.rollout.max_context))
    engine = RolloutEngine(sampler, tokenizer, suite.env, rollout_config(config), seed=int(config.seed))
    judging = Judging(config, suite, local_model=(model, tokenizer))
    store = RecordStore(os.path.join(config.workdir, "trajectories.jsonl"))
    done = store.done_ids()
    tasks_by_id = {t.id: t for t in suite.tasks}
    tree = config.rollout.tree
    started = time.perf_counter()
    try:
        if tree.enabled:
            todo = [(f"{t.id}#tree", t) for t in suite.tasks if f"{t.id}#tree" not in done]
            bar = tqdm(total=len(todo), desc="trees", disable=not config.progress)
            for record in engine.run_trees(todo, n=int(tree.n), f=int(tree.f), schedule=tree.schedule,
                                           fork_depths=tuple(tree.fork_depths), seed=int(config.seed)):
                store.append(judging.judge_tree(tasks_by_id[record.query_id], record))
                bar.update(1)
        else:
            todo = [(f"{t.id}#{e}", t) for t in suite.tasks for e in range(int(config.rollout.episodes_per_task))]
            todo = [(i, t) for i, t in todo if i not in done]
            bar = tqdm(total=len(todo), desc="episodes", disable=not config.progress)
            for trajectory in engine.run(todo):
                store.append(judging.judge_trajectory(tasks_by_id[trajectory.query_id], trajectory))
                bar.update(1)
        bar.close()
    finally:
        engine.close()
    wall_s = time.perf_counter() - started

    records = store.load()
    trajectories = [r for r in records if isinstance(r, Trajectory)]
    for record in records:
        if isinstance(record, TreeRecord):
            for leaf in record.leaves():
                traj = record.trajectory(leaf)
                verdict = record.metadata.get("leaf_verdicts", {}).get(str(leaf), {})
                traj.judgements = {"outcome": verdict, "process": []}
                trajectories.append(traj)
    metrics = trajectory_metrics(trajectories)
    stats = engine.stats
    metrics.update({
        "task": config.task.name, "model": config.model.source, "wall_s_this_run": wall_s,
        "tokens_per_s": stats.generated_tokens / stats.generate_s if stats.generate_s else None,
        "time_s": {"generate": stats.generate_s, "prefill": stats.prefill_s, "append": stats.append_s,
                   "tool_wait": stats.tool_wait_s},
        "rollout_stats": stats.to_json(),
    })
    write_json_atomic(os.path.join(config.workdir, "metrics.json"), metrics)
    summary_plot(metrics, trajectories, os.path.join(config.workdir, "summary.png"),
                 title=f"{config.task.name} / {config.model.source}")
    return metrics
