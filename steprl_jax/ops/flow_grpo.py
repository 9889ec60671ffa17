"""Flow-GRPO's advantages and token weights (AgentFlow, Li et al. 2025, arXiv 2510.05592): one
judged outcome per rollout, broadcast to every planner call (row) of the rollout.

A query has G rollouts; rollout g has rows (planner calls) with `tokens[g][k]` response tokens
each and one reward r_g (None: its verdict failed; it gets no advantage, no weight, and counts in
no statistic).

    normalize="rollout"  (the paper; Agent Lightning 1.0's `enable_rollout_level_advantage` with
                         `loss_mode: per_rollout_mean`) A_g = (r_g - mean_g r) / (std_g r + eps)
                         over the G rollouts, the same on each of g's rows; token weight
                         1 / (response tokens of rollout g): a token mean inside each rollout, and
                         since the train step divides by the sum of the weights, a mean over
                         rollouts, each rollout weighing the same whatever its number of rows.
    normalize="row"      (the published AgentFlow code: verl's GRPO over every planner-call row of
                         the query, uid = the question) mean/std over the rows, each row carrying
                         its rollout's reward, so a rollout of 3 rows counts 3 times; token weight
                         1 (verl's token-mean over the batch), so its tokens weigh 3 times too.

`ddof` 1 (torch.std, verl's and Agent Lightning's GRPO) by default; a group whose statistic has
no spread (all rewards equal, or too few members for `ddof`) gets advantage 0.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

NORMALIZE = ("rollout", "row")
DEFAULT_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class RolloutWeights:
    """One rollout's advantage (the same on all its rows) and the loss weight of each of its tokens."""

    advantage: float
    token_weight: float


def _zscore(values: np.ndarray, counts: np.ndarray, ddof: int, eps: float) -> np.ndarray:
    """z-scores of `values`, each counted `counts` times in the mean and std."""
    total = counts.sum()
    if total <= ddof or total == 0:
        return np.zeros_like(values)
    mean = (values * counts).sum() / total
    std = np.sqrt((np.square(values - mean) * counts).sum() / (total - ddof))
    return (values - mean) / (std + eps)


def flow_advantages(rewards: Sequence[Optional[float]], tokens: Sequence[Sequence[int]], *,
                    normalize: str = "rollout", ddof: int = 1, eps: float = DEFAULT_EPS) -> list[Optional[RolloutWeights]]:
    """Per rollout of one query: its advantage and token weight (None where its reward is None or it
    has no response token to train)."""
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    if len(rewards) != len(tokens):
        raise ValueError(f"{len(rewards)} rewards for {len(tokens)} rollouts")
    live = [g for g, (r, t) in enumerate(zip(rewards, tokens)) if r is not None and sum(t) > 0]
    out: list[Optional[RolloutWeights]] = [None] * len(rewards)
    if not live:
        return out
    values = np.asarray([float(rewards[g]) for g in live], np.float64)
    rows = np.asarray([len(tokens[g]) for g in live], np.float64)
    counts = np.ones_like(values) if normalize == "rollout" else rows
    advantages = _zscore(values, counts, ddof, eps)
    for g, a in zip(live, advantages):
        weight = 1.0 / sum(tokens[g]) if normalize == "rollout" else 1.0
        out[g] = RolloutWeights(float(a), weight)
    return out


def rollout_total_weights(weights: Sequence[Optional[RolloutWeights]], tokens: Sequence[Sequence[int]]) -> list[float]:
    """The share of the loss each rollout carries: the sum of its tokens' weights (0 without)."""
    return [0.0 if w is None else w.token_weight * sum(t) for w, t in zip(weights, tokens)]
