"""GRPO and GRPO_fm (METHODS 2.8): n independent trajectories per query, one advantage per
trajectory: the group z-score of its reward, on every generated token of the trajectory.

grpo      reward R_out (+1 / 0 / -1); loss seq_mean_token_mean, optional KL to the initial policy
grpo_fm   reward R_out + the mean R_fm of the trajectory's steps (our reading of "formatting
          reward added to the trajectory reward"; R_fm = c * fm_score, c = min(fm_scale, gamma**T_max / 2))

Std convention: `ddof` 1 by default, the sample std of verl's GRPO (torch.std); 0 = population.
The builders here (`group_builder`, `group_loss`, `read_group`) are shared with DAPO and ARPO.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from steprl_jax.agents.records import TreeRecord
from steprl_jax.agents.schedules.group import GroupSettings
from steprl_jax.agents.tree_batch import fm_score
from steprl_jax.algorithms.base import Algorithm, policy_temperature
from steprl_jax.algorithms.tree_rows import LOSS_AGGS, leaf_rows
from steprl_jax.errors import ConfigError
from steprl_jax.ops.advantages import grouped_advantages
from steprl_jax.tools.formats import format_cap
from steprl_jax.training.config import LossConfig


@dataclasses.dataclass(frozen=True)
class GroupMethodSettings:
    """A trajectory-reward method's settings (config.rl.<section>, plus the shared rl and rollout fields)."""

    rollout: Any  # the schedule's settings
    temperature: float
    agg: str
    ddof: int
    eps_low: float
    eps_high: float
    kl_coef: float = 0.0
    fm_cap: float = 0.0  # R_fm = fm_cap * fm_score
    max_row_tokens: Optional[int] = None


def read_section(config, section: str) -> dict:
    """The fields every method reads the same way from config.rl.<section>."""
    s = config.rl[section]
    if s.agg not in LOSS_AGGS:
        raise ConfigError(f"config.rl.{section}.agg: {s.agg!r} is not one of {LOSS_AGGS}")
    return dict(temperature=policy_temperature(config), agg=str(s.agg), eps_low=float(s.eps_low),
                eps_high=float(s.eps_high), max_row_tokens=int(config.rl.max_row_tokens) or None)


def read_group(config, section: str = "grpo", rollout=None) -> dict:
    s = config.rl[section]
    return dict(read_section(config, section), rollout=rollout or GroupSettings.from_config(config),
                ddof=int(s.ddof), kl_coef=float(s.get("kl_coef", 0.0)),
                fm_cap=format_cap(float(config.rl.fm_scale), float(config.rl.gamma), int(config.rollout.max_steps)))


def path_fm(record: TreeRecord, leaf: int, cap: float) -> float:
    """The mean R_fm (= cap * fm_score) over the steps of the leaf's trajectory."""
    return float(np.mean([cap * fm_score(record.nodes[i].step) for i in record.path(leaf)]))


def outcome_reward(record: TreeRecord, leaf: int) -> float:
    return float(record.leaf_outcomes[str(leaf)])


def group_builder(reward: Callable, masked: Optional[Callable] = None) -> Callable:
    """A builder: `reward(record, leaf, settings)` per trajectory -> z-scores per query -> rows whose
    every token of a trajectory carries its advantage (shared ARPO prefixes: once per trajectory).
    `masked(record, leaf, settings)`: trajectories that train no token while their reward still
    counts in their group's mean and std (SimpleTIR's void turns)."""

    def build(trees: Sequence[TreeRecord], s: GroupMethodSettings):
        rewards = [[reward(t, leaf, s) for leaf in t.leaves()] for t in trees]
        advantages = grouped_advantages(rewards, "zscore", ddof=s.ddof)
        rows, masked_count = [], 0
        for tree, adv in zip(trees, advantages):
            by_leaf = dict(zip(tree.leaves(), adv))
            off = frozenset(leaf for leaf in tree.leaves() if masked is not None and masked(tree, leaf, s))
            masked_count += len(off)
            rows += leaf_rows(tree, lambda leaf, node, by_leaf=by_leaf: by_leaf[leaf], agg=s.agg,
                              weighting="per_trajectory", max_row_tokens=s.max_row_tokens, masked=off)
        flat = [r for group in rewards for r in group]
        metrics = {"reward": float(np.mean(flat)),
                   "advantage_abs": float(np.mean(np.abs(np.concatenate(advantages)))),
                   "zero_std_groups": float(sum(np.std(g) == 0 for g in rewards))}
        if masked is not None:
            metrics["masked_trajectories"] = float(masked_count)
        return rows, metrics

    return build


def group_loss(s) -> LossConfig:
    return LossConfig(kind="policy", agg="token_mean", eps_low=s.eps_low, eps_high=s.eps_high, kl_coef=s.kl_coef,
                      temperature=s.temperature)


def outcome_only(record, leaf, s) -> float:
    return outcome_reward(record, leaf)


def outcome_plus_fm(record, leaf, s) -> float:
    return outcome_reward(record, leaf) + path_fm(record, leaf, s.fm_cap)


def read(config) -> GroupMethodSettings:
    return GroupMethodSettings(**read_group(config, "grpo"))


GRPO = Algorithm("grpo", "grpo", "group", read, group_builder(outcome_only), group_loss)
GRPO_FM = Algorithm("grpo_fm", "grpo", "group", read, group_builder(outcome_plus_fm), group_loss)
