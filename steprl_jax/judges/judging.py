"""Outcome and process verdicts for many finished trajectories at once: the one judging interface
every job uses (evaluation, SWiRL's judge stage, the online RL loop).

    judging = Judging.from_config(config, outcome_rule=suite.outcome_rule, local_model=(model, tok))
    judging.judge(pairs)        # [(task, trajectory)], sets trajectory.judgements in place

Model judges (local or HTTP) get every item of the batch in one `judge(items)` call, which runs
them concurrently on a thread pool; rule judges are instant. A verdict that fails (backend down
after its retries, unreadable replies) is recorded as label "failed" with its reason, never
counted as GOOD/BAD or true/false.

`outcome_rule(task, trajectory) -> "true" | "false" | "unable_to_answer"` is the task's own
answer check (agents/tasks.py); judges do not depend on the agents package.

`solution_reference(task) -> SolutionReference | None` (the math tasks') adds the reference-guided
step judge's verdicts as `judgements["reference_process"]`, for measuring beside the process judge
the policy is filtered or rewarded by; `judge.process.kind=reference` makes it the process judge
itself, an experiment's stand-in for a strong LLM judge (it sees the golden solution).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from steprl_jax.judges import rules
from steprl_jax.judges.items import StepItem, outcome_item, step_items, trajectory_item

FAILED = "failed"
# YES/NO of the model outcome judge read as PORTool's verdicts.
_YES_NO = {"YES": rules.TRUE, "NO": rules.FALSE}
# How each action format's trajectories are judged: (tree_format: a model outcome judge gives
# PORTool's true / false / unable_to_answer verdict on the whole trajectory, else YES/NO against
# the answer key; rule_process: the rule process judge applies, defined for SWiRL's tags only).
# "flow": AgentFlow's planner rollouts (agents/schedules/flow.py), judged on the solution's answer.
FORMATS = {"tags": (False, True), "tool_call": (True, False), "code": (False, False),
           "code_turns": (False, False), "flow": (False, False)}


class Judging:
    def __init__(self, *, outcome_judge=None, process_judge=None, outcome_rule: Optional[Callable] = None,
                 tree_format: bool = False, outcome_kind: str = "rule", process_kind: str = "rule",
                 rule_process: Optional[bool] = None, solution_reference: Optional[Callable] = None):
        """`outcome_judge`/`process_judge`: model judges (judges.model_judges) or None for the rule
        path (`outcome_rule`, and `RuleProcessJudge` for SWiRL's tag actions when `rule_process`,
        by default for any format but the tree one). `solution_reference`: see the module docstring;
        it judges SWiRL's tag actions only (`rule_process`)."""
        from steprl_jax.judges.rule_judges import ReferenceProcessJudge, RuleProcessJudge

        if outcome_judge is None and outcome_rule is None:
            raise ValueError("Judging needs an outcome judge or an outcome rule")
        self.outcome_judge, self.outcome_rule = outcome_judge, outcome_rule
        rule_process = not tree_format if rule_process is None else rule_process
        self.process_judge = process_judge if process_judge is not None or not rule_process else RuleProcessJudge()
        self.tree_format = tree_format
        self.outcome_kind, self.process_kind = outcome_kind, process_kind
        has_reference = solution_reference is not None and rule_process
        self.solution_reference = solution_reference if has_reference else None
        self.reference_judge = ReferenceProcessJudge() if has_reference else None
        if process_kind == "reference":
            if not has_reference:
                raise ValueError("judge.process.kind=reference needs the math tasks' reference solutions "
                                 "(task.name arithmetic or gsm8k) and SWiRL's tag format (env.format=tags)")
            self.process_judge = None

    @classmethod
    def from_config(cls, config, *, outcome_rule: Callable, local_model=None,
                    solution_reference: Optional[Callable] = None) -> "Judging":
        """From `config.judge.{outcome,process}` (kind rule | local | http; the process judge also
        reference) and `config.env.format` (`FORMATS`)."""
        if config.env.format not in FORMATS:
            raise ValueError(f"config.env.format: {config.env.format!r} is not one of {tuple(FORMATS)}")
        tree_format, rule_process = FORMATS[config.env.format]
        cache_dir = config.judge.cache_dir or os.path.join(config.workdir, "judge_cache")
        judges = {}
        for role, cfg in (("outcome", config.judge.outcome), ("process", config.judge.process)):
            if cfg.kind in ("rule", "reference"):
                judges[role] = None
                continue
            from steprl_jax.judges import build_backend
            from steprl_jax.judges.model_judges import OutcomeJudge, ProcessJudge, TrajectoryVerdictJudge

            backend = build_backend(dict(cfg), cache_dir=cache_dir, local_model=local_model)
            kind = ProcessJudge if role == "process" else TrajectoryVerdictJudge if tree_format else OutcomeJudge
            judges[role] = kind(backend, votes=int(cfg.votes))
        return cls(outcome_judge=judges["outcome"], process_judge=judges["process"], outcome_rule=outcome_rule,
                   tree_format=tree_format, outcome_kind=config.judge.outcome.kind,
                   process_kind=config.judge.process.kind, rule_process=rule_process,
                   solution_reference=solution_reference)

    # ------------------------------------------------------------------ batches
    def outcomes(self, pairs: Sequence[tuple[Any, Any]]) -> list[dict]:
        """One outcome verdict dict per (task, trajectory): label, score (R_out) and the judge's detail."""
        if self.outcome_judge is None:
            out = []
            for task, trajectory in pairs:
                label = self.outcome_rule(task, trajectory)
                out.append({"label": label, "score": rules.OUTCOME_REWARD[label], "judge": "rule"})
            return out
        items = [(trajectory_item if self.tree_format else outcome_item)(t) for _, t in pairs]
        out = []
        for verdict in self.outcome_judge.judge(items):
            label = verdict.label if self.tree_format else _YES_NO.get(verdict.label)
            out.append({**verdict.to_json(), "label": label or FAILED, "score": rules.OUTCOME_REWARD.get(label),
                        "judge": self.outcome_kind})
        return out

    def processes(self, pairs: Sequence[tuple[Any, Any]]) -> list[list[dict]]:
        """Per (task, trajectory), one process verdict per step (question + earlier steps + the
        step; no answer, but for kind "reference")."""
        if self.process_kind == "reference":
            return self.reference_processes(pairs)
        if self.process_judge is None:
            return [[] for _ in pairs]
        items = [step_items(t) for _, t in pairs]
        flat = self.process_judge.judge([item for per in items for item in per])
        out, start = [], 0
        for per in items:
            out.append([{**v.to_json(), "label": v.label or FAILED, "judge": self.process_kind}
                        for v in flat[start:start + len(per)]])
            start += len(per)
        return out

    def reference_processes(self, pairs: Sequence[tuple[Any, Any]]) -> list[list[dict]]:
        """Per (task, trajectory), the reference-guided step judge's verdict on each step ([] where
        the task has no reference solution)."""
        out = []
        for task, trajectory in pairs:
            reference = self.solution_reference(task)
            # it reads each action alone: no step needs the history rendered
            items = [] if reference is None else \
                [(StepItem(trajectory.question, (), step.action_text), reference) for step in trajectory.steps]
            out.append([{**v.to_json(), "label": v.label, "judge": "reference"}
                        for v in self.reference_judge.judge(items)])
        return out

    def judge(self, pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Set `trajectory.judgements = {"outcome": ..., "process": [...]}` for every pair, and
        `"reference_process"` where the tasks have reference solutions."""
        outcomes = self.outcomes(pairs)
        processes = self.processes(pairs)
        references = None
        if self.reference_judge is not None:
            references = processes if self.process_kind == "reference" else self.reference_processes(pairs)
        for i, ((_, trajectory), outcome, process) in enumerate(zip(pairs, outcomes, processes)):
            trajectory.judgements = {"outcome": outcome, "process": process}
            if references is not None:
                trajectory.judgements["reference_process"] = references[i]
        return [t for _, t in pairs]

    def judge_trees(self, pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Outcome verdicts of every leaf of every (task, tree) in one batched call: R_out in
        `tree.leaf_outcomes` (None when the judge failed), the verdict in `tree.leaf_verdicts`."""
        where = [(tree, leaf) for _, tree in pairs for leaf in tree.leaves()]
        verdicts = self.outcomes([(task, tree.trajectory(leaf)) for task, tree in pairs for leaf in tree.leaves()])
        for (tree, leaf), verdict in zip(where, verdicts):
            tree.leaf_outcomes[str(leaf)] = verdict["score"]
            tree.leaf_verdicts[str(leaf)] = verdict
        return [tree for _, tree in pairs]
