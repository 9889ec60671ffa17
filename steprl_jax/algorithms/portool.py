"""PORTool (METHODS 2.3-2.6): rollout trees, step importance rewards, fork + trajectory advantages.

Each query's judged tree goes through `ops.advantages.tree_advantages` (`config.rl.gamma`, adaptive
max/mean G, R_fm capped at `config.rl.fm_scale`, w1, w2 with the n_forks rescale and whether
gamma discounts failures too in `config.rl.portool`), one advantage per
step node, on every token of that step. The loss is the clipped token-level surrogate without
KL, averaged over the generated tokens of the query's trajectories (`query_token_mean` weights,
agents/tree_batch.py); how a step shared by several trajectories counts is
`config.rl.portool.token_weighting`: per_trajectory (the paper's sum over trajectories) or once.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from steprl_jax.agents.records import TreeRecord
from steprl_jax.agents.tree_batch import tree_arrays
from steprl_jax.algorithms.tree_rows import leaf_rows
from steprl_jax.algorithms.rl import Algorithm, policy_temperature
from steprl_jax.ops.advantages import tree_advantages
from steprl_jax.training.config import LossConfig


def tree_step_advantages(trees: Sequence[TreeRecord], config) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(R_n, A_n) per tree: one vmapped, jitted `tree_advantages` over trees padded to the same
    node count (a power of two, so a run compiles a handful of shapes)."""
    arrays = [tree_arrays(t) for t in trees]
    size = max(8, 1 << (max(len(a[0]) for a in arrays) - 1).bit_length())
    def pad(x, fill):
        return np.concatenate([x, np.full(size - len(x), fill, x.dtype)])
    parent = np.stack([pad(a[0], -1) for a in arrays])
    outcome = np.stack([pad(a[1], 0.0) for a in arrays])
    fm = np.stack([pad(a[2], 0.0) for a in arrays])
    valid = np.stack([np.arange(size) < len(a[0]) for a in arrays])
    s = config.rl.portool
    r, a = _advantages_fn(float(config.rl.gamma), float(config.rl.fm_scale), float(s.w1), float(s.w2),
                          bool(s.rescale_fork_weight), int(s.ddof),
                          bool(s.discount_failures))(parent, outcome, fm, valid)
    r, a = np.asarray(r), np.asarray(a)
    return [r[i, :len(x[0])] for i, x in enumerate(arrays)], [a[i, :len(x[0])] for i, x in enumerate(arrays)]


@functools.lru_cache(maxsize=None)
def _advantages_fn(gamma, fm_scale, w1, w2, rescale, ddof, discount_failures):
    """One jitted, vmapped program per setting (a new jit per call would retrace every iteration)."""
    def one(parent, outcome, fm, valid):
        return tree_advantages(parent, outcome, fm, gamma=gamma, fm_scale=fm_scale, w1=w1, w2=w2,
                               rescale_fork_weight=rescale, valid_n=valid, ddof=ddof,
                               discount_failures=discount_failures)
    return jax.jit(jax.vmap(one))


def build(trees: Sequence[TreeRecord], config):
    s = config.rl.portool
    step_rewards, advantages = tree_step_advantages(trees, config)
    rows = []
    for tree, adv in zip(trees, advantages):
        rows += leaf_rows(tree, lambda leaf, node, adv=adv: float(adv[node]), agg=s.agg,
                          weighting=s.token_weighting, max_row_tokens=int(config.rl.max_row_tokens) or None)
    outcomes = [float(t.leaf_outcomes[str(l)]) for t in trees for l in t.leaves()]
    forks = [sum(1 for c in np.bincount([n.parent + 1 for n in t.nodes]) if c > 1) for t in trees]
    metrics = {"reward": float(np.mean(outcomes)), "step_reward": float(np.mean(np.concatenate(step_rewards))),
               "advantage_abs": float(np.mean(np.abs(np.concatenate(advantages)))),
               "forks_per_tree": float(np.mean(forks))}
    return rows, metrics


def loss(config) -> LossConfig:
    s = config.rl.portool
    return LossConfig(kind="policy", agg="token_mean", eps_low=float(s.eps_low), eps_high=float(s.eps_high),
                      temperature=policy_temperature(config))


PORTOOL = Algorithm("portool", "tree", build, loss)
