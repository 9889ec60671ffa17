"""Advantage estimators: group baselines (GRPO, RLOO, Dr. GRPO, REINFORCE) and the PORTool tree, and
the one registry (`ADVANTAGES`) every method takes its estimator from (`group_advantages` on the host).

All are pure jittable functions of fixed-shape arrays; padding is marked by `valid_n` (False =
padding, contributes nothing and gets advantage 0).

Std convention (`ddof`): z-scores divide by `std + eps` where std uses `ddof=0` (population
std) by default; `ddof=1` gives the sample std of torch.std/verl (a group of one then gets 0).
A group whose std is 0 gets advantage 0 for every member (numerator is 0).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from steprl_jax.ops.flow_grpo import flow_advantages
from steprl_jax.ops.gigpo import gigpo_advantages
from steprl_jax.ops.tree_grpo import tree_grpo_advantages

DEFAULT_EPS = 1e-6


def _valid(rewards_n, valid_n):
    if rewards_n.ndim != 1:
        raise ValueError(f"rewards must be 1-D [n], got shape {rewards_n.shape}")
    if valid_n is None:
        return jnp.ones(rewards_n.shape, bool)
    if valid_n.shape != rewards_n.shape:
        raise ValueError(f"valid_n shape {valid_n.shape} != rewards shape {rewards_n.shape}")
    return valid_n.astype(bool)


def _group_stats(rewards_n, group_ids_n, num_groups, valid_n, ddof):
    """Per-member (count, mean, std) of its group, valid members only."""
    if group_ids_n.shape != rewards_n.shape:
        raise ValueError(f"group_ids shape {group_ids_n.shape} != rewards shape "
                         f"{rewards_n.shape}")
    v = valid_n.astype(jnp.float32)
    r = jnp.where(valid_n, rewards_n.astype(jnp.float32), 0.0)
    gid = jnp.where(valid_n, group_ids_n, num_groups)  # padding goes to a spare segment
    seg = lambda x: jax.ops.segment_sum(x, gid, num_segments=num_groups + 1)
    count_g = seg(v)
    mean_g = seg(r) / jnp.maximum(count_g, 1.0)
    count, mean = count_g[gid], mean_g[gid]
    sq = jnp.where(valid_n, jnp.square(r - mean), 0.0)
    var = seg(sq)[gid] / jnp.maximum(count - ddof, 1.0)
    return count, mean, jnp.sqrt(var)


def group_zscore(rewards_n, group_ids_n, num_groups: int, *, valid_n=None,
                 eps: float = DEFAULT_EPS, ddof: int = 0):
    """GRPO: (r - mean_group) / (std_group + eps); std with `ddof` (default population)."""
    valid_n = _valid(rewards_n, valid_n)
    count, mean, std = _group_stats(rewards_n, group_ids_n, num_groups, valid_n, ddof)
    adv = (rewards_n - mean) / (std + eps)
    if ddof:
        adv = jnp.where(count > ddof, adv, 0.0)
    return jnp.where(valid_n, adv, 0.0)


def group_rloo(rewards_n, group_ids_n, num_groups: int, *, valid_n=None):
    """RLOO: r minus the mean of the OTHER members of its group (0 for a group of one)."""
    valid_n = _valid(rewards_n, valid_n)
    count, mean, _ = _group_stats(rewards_n, group_ids_n, num_groups, valid_n, 0)
    adv = count / jnp.maximum(count - 1.0, 1.0) * (rewards_n - mean)
    return jnp.where(valid_n & (count > 1), adv, 0.0)


def group_mean_only(rewards_n, group_ids_n, num_groups: int, *, valid_n=None):
    """Dr. GRPO: r - mean_group, no std division."""
    valid_n = _valid(rewards_n, valid_n)
    _, mean, _ = _group_stats(rewards_n, group_ids_n, num_groups, valid_n, 0)
    return jnp.where(valid_n, rewards_n - mean, 0.0)


def reinforce_baseline(rewards_n, baseline, *, decay: float = 0.9, valid_n=None):
    """REINFORCE with a moving baseline: returns (r - b, decay * b + (1 - decay) * mean(r)).

    The baseline is the state the caller carries between batches (start it at 0.0); the
    advantage uses the baseline from BEFORE this batch, so it stays independent of r.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    valid_n = _valid(rewards_n, valid_n)
    v = valid_n.astype(jnp.float32)
    batch_mean = jnp.sum(rewards_n * v) / jnp.maximum(jnp.sum(v), 1.0)
    new_baseline = jnp.where(jnp.sum(v) > 0, decay * baseline + (1.0 - decay) * batch_mean,
                             baseline)
    return jnp.where(valid_n, rewards_n - baseline, 0.0), new_baseline


# ---- PORTool rollout tree ------------------------------------------------------------------
def _zscore_masked(x, mask, eps, ddof):
    m = mask.astype(jnp.float32)
    n = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - ddof, 1.0)
    return jnp.where(mask, (x - mean) / (jnp.sqrt(var) + eps), 0.0)


def tree_structure(parent_n, valid_n):
    """Ancestor matrix, 1-based depth, children counts and leaf flags of a padded tree.

    anc_nn[i, j] is True when node j is node i or one of its ancestors. Computed by repeated
    boolean squaring (log2(N) steps), so it is jittable for any fixed N.
    """
    n = parent_n.shape[0]
    valid_n = valid_n.astype(bool)
    has_parent = valid_n & (parent_n >= 0)
    par = jnp.where(has_parent, parent_n, 0)
    step_nn = jnp.eye(n, dtype=bool) | (jax.nn.one_hot(par, n, dtype=bool) & has_parent[:, None])
    anc_nn = step_nn
    for _ in range(max(1, (n - 1).bit_length())):
        anc_nn = anc_nn | (jnp.matmul(anc_nn.astype(jnp.float32),
                                      anc_nn.astype(jnp.float32)) > 0)
    anc_nn = anc_nn & valid_n[:, None] & valid_n[None, :]
    depth_n = jnp.sum(anc_nn, axis=1).astype(jnp.int32)
    n_children_n = jnp.sum(jax.nn.one_hot(par, n, dtype=jnp.int32) * has_parent[:, None], axis=0)
    is_leaf_n = valid_n & (n_children_n == 0)
    return anc_nn, depth_n, n_children_n, is_leaf_n


def tree_advantages(parent_n, leaf_outcome_n, fm_reward_n, *, gamma: float = 0.95,
                    fm_scale: float = 0.25, w1: float = 1.0, w2: float = 1.0,
                    rescale_fork_weight: bool = True, valid_n=None, eps: float = DEFAULT_EPS,
                    ddof: int = 0, discount_failures: bool = True) -> Tuple[jax.Array, jax.Array]:
    """PORTool step rewards `R_n` and advantages `A_n` for ONE query's tree (METHODS 2.4-2.5).

    Nodes are steps. `parent_n[i]` is the node before step i (-1 for a first step); a
    trajectory is the path from a first step to a leaf; `leaf_outcome_n` (+1/0/-1) is read at
    leaves only; `fm_reward_n` in [-1, 1] is the unscaled formatting score. Pad with
    `valid_n=False`; vmap over queries. Validate `parent_n` on the host first
    (`tree_arrays.validate_tree`): a cycle cannot raise here.

      depth t(s) counts from 1; T_k = depth of leaf k; m(s) = leaves below or at s.
      v(s, k) = gamma**(T_k - t(s)) * R_out(k) for k in m(s) (the paper's formula).
         With `discount_failures=False`, v(s, k) = R_out(k) where R_out(k) < 0: the discount
         favours shorter successful continuations only. Discounting a failure as well makes
         a wrong answer given later score above the same answer given sooner (-gamma**5 >
         -1), so on trees whose outcomes are mostly wrong the fork term pays for more steps.
      G: per sibling set C(p) (first steps are siblings under the prompt), if the max-aggregates
         max_k v(s, k) differ across the set, R uses them; if they all tie, R uses the means.
         A node without siblings is a one-member set, hence uses the mean.
      R(s) = G(s) + c * fm(s),  c = min(fm_scale, gamma**T_max / 2).
      A_trj(k) = z-score of R_out over the tree's trajectories; at node s: mean over m(s).
      A_fork(s) = z-score of R(s) over C(parent(s)); 0 when the set has one member. Ties are
         exact: siblings whose R differ by no more than float32 rounding (bound in the code)
         count as equal, so they share one A_fork, and a set whose R all tie gets 0.
      A(s) = w1 * A_trj(s) + w2_eff * A_fork(s),
      w2_eff = w2 * n_traj / max(1, n_forks) if `rescale_fork_weight` else w2, where n_forks
      counts nodes with > 1 children, the prompt included when it has > 1 first steps.
    """
    if parent_n.ndim != 1:
        raise ValueError(f"parent_n must be 1-D [nodes] (vmap for batches), got {parent_n.shape}")
    for name, arr in (("leaf_outcome_n", leaf_outcome_n), ("fm_reward_n", fm_reward_n)):
        if arr.shape != parent_n.shape:
            raise ValueError(f"{name} shape {arr.shape} != parent_n shape {parent_n.shape}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if fm_scale < 0:
        raise ValueError(f"fm_scale must be >= 0, got {fm_scale}")
    n = parent_n.shape[0]
    valid_n = jnp.ones((n,), bool) if valid_n is None else valid_n.astype(bool)
    parent_n = parent_n.astype(jnp.int32)
    anc_nn, depth_n, n_children_n, is_leaf_n = tree_structure(parent_n, valid_n)
    depth_f = depth_n.astype(jnp.float32)
    out_n = jnp.where(is_leaf_n, leaf_outcome_n.astype(jnp.float32), 0.0)

    # member_sk[s, k]: leaf k's trajectory passes through s.
    member_sk = anc_nn.T & is_leaf_n[None, :]
    n_member_s = jnp.sum(member_sk, axis=1).astype(jnp.float32)
    disc_sk = jnp.power(jnp.float32(gamma), depth_f[None, :] - depth_f[:, None])
    if not discount_failures:
        disc_sk = jnp.where(out_n[None, :] < 0, 1.0, disc_sk)
    val_sk = jnp.where(member_sk, disc_sk * out_n[None, :], 0.0)
    max_s = jnp.max(jnp.where(member_sk, val_sk, -jnp.inf), axis=1)
    max_s = jnp.where(n_member_s > 0, max_s, 0.0)
    mean_s = jnp.sum(val_sk, axis=1) / jnp.maximum(n_member_s, 1.0)

    # Sibling sets keyed by parent; the prompt (parent -1) is key n.
    key_n = jnp.where(valid_n, jnp.where(parent_n >= 0, parent_n, n), n + 1)
    nseg = n + 2
    gmax = jax.ops.segment_max(jnp.where(valid_n, max_s, -jnp.inf), key_n, num_segments=nseg)
    gmin = jax.ops.segment_min(jnp.where(valid_n, max_s, jnp.inf), key_n, num_segments=nseg)
    n_sib_n = jax.ops.segment_sum(valid_n.astype(jnp.int32), key_n, num_segments=nseg)[key_n]
    siblings_tie = gmax[key_n] == gmin[key_n]
    g_s = jnp.where(siblings_tie, mean_s, max_s)

    t_max = jnp.max(jnp.where(is_leaf_n, depth_f, 0.0))
    c = jnp.minimum(jnp.float32(fm_scale), jnp.power(jnp.float32(gamma), t_max) / 2.0)
    r_n = jnp.where(valid_n, g_s + c * fm_reward_n.astype(jnp.float32), 0.0)

    a_trj_k = _zscore_masked(out_n, is_leaf_n, eps, ddof)
    a_trj_s = jnp.sum(jnp.where(member_sk, a_trj_k[None, :], 0.0), axis=1) / jnp.maximum(
        n_member_s, 1.0)

    # Ties are exact (METHODS 2.8). R is a float32 mean summed in node order, so siblings whose
    # sub-trees hold the same (outcome, depth) pairs in another order can differ by a rounding
    # step, and a mean of k bit-equal R is not always R either; over (std + eps) such a residue
    # became a fork advantage of up to ~0.4. So siblings within rounding of each other take one
    # value (the least of those close to it) and a set whose values all coincide gets A_fork = 0.
    # Rounding bound: a float32 sum of m terms is within (m - 1) * eps/2 * sum|term| of the exact
    # sum in any order; divided by m (m = leaves below s, |term| <= vmax(s) = max_k |v(s, k)|),
    # plus the roundings of the division and of adding c * fm, R(s) is within
    # (m + 2) * eps/2 * mag(s), mag(s) = vmax(s) + |c * fm(s)| >= |R(s)|. tol(s) is twice that
    # (eps = float32 machine epsilon, ~1.2e-7): relative to the magnitudes R is made of (a sum of
    # +1 and -1 rounds on the scale of 1, not of its result), and far below the differences
    # rewards really show (a formatting check moves R by c/3; one leaf's outcome or depth moves
    # a mean by ~(1 - gamma) * gamma**T / m or more: ~5e-4 against tol ~2e-5 for m = 64).
    vmax_s = jnp.max(jnp.abs(val_sk), axis=1)
    mag_s = vmax_s + jnp.abs(c * fm_reward_n.astype(jnp.float32))
    tol_s = (n_member_s + 2.0) * jnp.finfo(jnp.float32).eps * mag_s
    same_set_nn = (key_n[:, None] == key_n[None, :]) & valid_n[:, None] & valid_n[None, :]
    close_nn = same_set_nn & (jnp.abs(r_n[:, None] - r_n[None, :])
                              <= tol_s[:, None] + tol_s[None, :])
    r_tie_n = jnp.where(valid_n, jnp.min(jnp.where(close_nn, r_n[None, :], jnp.inf), axis=1),
                        0.0)

    # Fork z-scores per sibling set, via segment sums; 0 for a set without spread.
    seg = lambda x: jax.ops.segment_sum(x, key_n, num_segments=nseg)[key_n]
    vf = valid_n.astype(jnp.float32)
    sib_hi = jax.ops.segment_max(jnp.where(valid_n, r_tie_n, -jnp.inf), key_n, num_segments=nseg)
    sib_lo = jax.ops.segment_min(jnp.where(valid_n, r_tie_n, jnp.inf), key_n, num_segments=nseg)
    sib_mean = seg(r_tie_n * vf) / jnp.maximum(n_sib_n, 1)
    sib_var = seg(jnp.square(r_tie_n - sib_mean) * vf) / jnp.maximum(n_sib_n - ddof, 1)
    a_fork_s = jnp.where(valid_n & (sib_hi > sib_lo)[key_n],
                         (r_tie_n - sib_mean) / (jnp.sqrt(sib_var) + eps), 0.0)

    n_traj = jnp.sum(is_leaf_n.astype(jnp.float32))
    n_first = jnp.sum((valid_n & (parent_n < 0)).astype(jnp.int32))
    n_forks = jnp.sum((n_children_n > 1).astype(jnp.float32)) + (n_first > 1)
    w2_eff = w2 * n_traj / jnp.maximum(1.0, n_forks) if rescale_fork_weight else w2
    a_n = jnp.where(valid_n, w1 * a_trj_s + w2_eff * a_fork_s, 0.0)
    return r_n, a_n


# The estimators, by the names configs use: group baselines take (rewards_n, group_ids_n,
# num_groups, valid_n=...); the tree estimator takes one query's tree (`tree_advantages`).
ADVANTAGES: Dict[str, Callable] = {
    "zscore": group_zscore,  # GRPO
    "rloo": group_rloo,
    "dr_grpo": group_mean_only,
    "portool": tree_advantages,
    "gigpo": gigpo_advantages,
    "tree_grpo": tree_grpo_advantages,
    "flow_grpo": flow_advantages,  # one query's rollouts of planner-call rows (ops/flow_grpo.py)
}
GROUP_ESTIMATORS = ("zscore", "rloo", "dr_grpo")


def group_advantages(rewards: Sequence[Optional[float]], group_ids: Sequence[int], num_groups: int,
                     estimator: str = "zscore", *, eps: float = DEFAULT_EPS, ddof: int = 0,
                     scale_by_std: bool = False) -> np.ndarray:
    """Host side: per-sample advantages of a flat list of rewards by the registered group
    `estimator`; a sample whose reward failed (None) gets 0 and counts in no group. With
    `scale_by_std` RLOO is also divided by its group's (population) std + eps (SWiRL's option)."""
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown group estimator {estimator!r}; valid: {', '.join(GROUP_ESTIMATORS)}")
    valid = np.asarray([r is not None for r in rewards], bool)
    r = np.asarray([0.0 if x is None else float(x) for x in rewards], np.float32)
    g = np.asarray(group_ids, np.int32)
    kwargs = {"eps": eps, "ddof": ddof} if estimator == "zscore" else {}
    # np.array: a writable copy (np.asarray of a jax array is a read-only view)
    adv = np.array(ADVANTAGES[estimator](jnp.asarray(r), jnp.asarray(g), num_groups, valid_n=jnp.asarray(valid),
                                         **kwargs))
    if scale_by_std and estimator == "rloo":
        for group in range(num_groups):
            members = (g == group) & valid
            if members.sum() > 1:
                adv[members] /= r[members].std() + eps
    return np.where(valid, adv, 0.0)


def grouped_advantages(groups: Sequence[Sequence[Optional[float]]], estimator: str = "zscore", **kwargs
                       ) -> list[np.ndarray]:
    """`group_advantages` of rewards given as one list per group; one array per group back."""
    flat = [r for group in groups for r in group]
    ids = [g for g, group in enumerate(groups) for _ in group]
    adv = group_advantages(flat, ids, len(groups), estimator, **kwargs)
    out, start = [], 0
    for group in groups:
        out.append(adv[start:start + len(group)])
        start += len(group)
    return out
