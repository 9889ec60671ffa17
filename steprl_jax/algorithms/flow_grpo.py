"""Flow-GRPO (AgentFlow, Li et al. 2025, arXiv 2510.05592; reference lupantech/AgentFlow,
train/config.yaml and agentflow/verl/): only the planner of a planner / executor / verifier /
solution-generator system is trained (agents/flow.py, the `flow` schedule).

* n rollouts per query (AgentFlow: 8), each up to `rl.flow_grpo.max_turns` planner calls (3);
* reward: the judged outcome of the rollout's final answer (math-verify here: +1 / -1; the
  reference's GPT-4o judge gives 1 / 0, the same z-scores), broadcast to every planner call;
* one training row per planner call: its exact prompt ids and sampled ids, the sampler's log-probs
  (the first update has ratio 1);
* advantages and token weights: ops/flow_grpo.py, `rl.flow_grpo.normalize` "rollout" (default: the
  paper's group normalisation over rollouts, each rollout weighing the same, Agent Lightning 1.0's
  `enable_rollout_level_advantage` + `per_rollout_mean`) or "row" (the published code: verl's GRPO
  over the rows, token mean over the batch);
* loss: the clipped surrogate with clip 0.2 / 0.3 and a KL loss 0.001 to the initial policy (the
  reference's `use_kl_loss`, low_var_kl = our k3), no entropy term.

Departures: the reference samples the planner with frequency_penalty 1.2, so its samples are not
from the policy it trains; we sample the policy itself (`rollout.temperature`, top_p). It drops rows
whose prompt exceeds its limit after computing advantages; here a prompt that leaves no room for a
reply is never sampled, so the rollout's planning ends there (the solution generator still answers).
Held-out evaluation runs the same system (evaluation/runner.py): `rl.eval.episodes_per_task`
rollouts a query, the planner at `rl.eval.temperature`, the frozen modules the base model.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from steprl_jax.agents.records import TreeRecord
from steprl_jax.agents.schedules.flow import FlowSettings
from steprl_jax.algorithms.base import Algorithm, policy_temperature
from steprl_jax.errors import ConfigError
from steprl_jax.ops.flow_grpo import NORMALIZE, flow_advantages
from steprl_jax.training.config import LossConfig
from steprl_jax.training.pack import Row, Span


@dataclasses.dataclass(frozen=True)
class FlowGrpoSettings:
    rollout: FlowSettings
    temperature: float
    normalize: str
    ddof: int
    eps_low: float
    eps_high: float
    kl_coef: float


def read(config) -> FlowGrpoSettings:
    f = config.rl.flow_grpo
    if f.normalize not in NORMALIZE:
        raise ConfigError(f"config.rl.flow_grpo.normalize: {f.normalize!r} is not one of {NORMALIZE}")
    if int(f.max_turns) < 1:
        raise ConfigError(f"config.rl.flow_grpo.max_turns must be >= 1, got {f.max_turns}")
    return FlowGrpoSettings(rollout=FlowSettings.from_config(config), temperature=policy_temperature(config),
                            normalize=str(f.normalize), ddof=int(f.ddof), eps_low=float(f.eps_low),
                            eps_high=float(f.eps_high), kl_coef=float(f.kl_coef))


def rollout_calls(record: TreeRecord) -> list[tuple[int, list]]:
    """(leaf, its planner calls' steps in order) per rollout of a flow record."""
    return [(leaf, [record.nodes[i].step for i in record.path(leaf)]) for leaf in record.leaves()]


def build(trees: Sequence[TreeRecord], s: FlowGrpoSettings):
    """One row per planner call: [prompt | reply], the reply trained with its rollout's advantage
    and token weight."""
    rows, rewards, advantages, row_counts = [], [], [], []
    for tree in trees:
        rollouts = rollout_calls(tree)
        outcomes = [tree.leaf_outcomes.get(str(leaf)) for leaf, _ in rollouts]
        tokens = [[len(step.action_ids) for step in steps] for _, steps in rollouts]
        weights = flow_advantages(outcomes, tokens, normalize=s.normalize, ddof=s.ddof)
        for (_, steps), outcome, w in zip(rollouts, outcomes, weights):
            if outcome is not None:
                rewards.append(float(outcome))
            if w is None:
                continue
            advantages.append(w.advantage)
            row_counts.append(len(steps))
            for step in steps:
                if not step.action_ids:
                    continue
                if step.prompt_ids is None:
                    raise ValueError(f"{tree.id}: a planner call without its prompt ids (not a flow record?)")
                rows.append(Row([Span(list(step.prompt_ids)),
                                 Span(list(step.action_ids), loss=True, logprobs=list(step.action_logprobs),
                                      advantage=w.advantage, weight=w.token_weight)]))
    metrics = {"reward": float(np.mean(rewards)) if rewards else 0.0,
               "advantage_abs": float(np.mean(np.abs(advantages))) if advantages else 0.0,
               "planner_rows": float(len(rows)),
               "rows_per_rollout": float(np.mean(row_counts)) if row_counts else 0.0}
    return rows, metrics


def loss(s: FlowGrpoSettings) -> LossConfig:
    return LossConfig(kind="policy", agg="token_mean", eps_low=s.eps_low, eps_high=s.eps_high, kl_coef=s.kl_coef,
                      temperature=s.temperature)


FLOW_GRPO = Algorithm("flow_grpo", "flow_grpo", "flow", read, build, loss, formats=("flow",))
