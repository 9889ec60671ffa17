"""DAPO (Yu et al. 2025), a PORTool baseline: clip-higher, dynamic sampling, token-level loss,
overlong reward shaping, no KL.

* clip-higher: eps_low 0.2, eps_high 0.28 (`config.rl.dapo`).
* dynamic sampling: a query whose trajectories all get the same R_out is dropped and the loop
  rolls out more queries until the batch is full (`max_sampling_rounds` caps the attempts).
* token_mean: every generated token of the batch weighs the same.
* overlong shaping: a trajectory of L generated tokens gets
  0 for L <= L_max - L_cache, (L_max - L_cache - L) / L_cache up to L_max, and -1 beyond,
  added to R_out; L_max is `max_response_tokens` (0: max_steps x max_new_tokens).
"""
from __future__ import annotations

from steprl_jax.agents.records import TreeRecord
from steprl_jax.algorithms.grpo import grpo_loss, group_builder, outcome_reward
from steprl_jax.algorithms.rl import Algorithm
from steprl_jax.errors import ConfigError


def overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment (0, then linear down to -1 over the last `cache` tokens)."""
    if cache <= 0 or cache > max_length:
        raise ValueError(f"overlong cache {cache} must be in [1, max_length={max_length}]")
    if length <= max_length - cache:
        return 0.0
    if length <= max_length:
        return (max_length - cache - length) / cache
    return -1.0


def max_response_tokens(config) -> int:
    s = config.rl.dapo
    return int(s.max_response_tokens) or int(config.rollout.max_steps) * int(config.rollout.max_new_tokens)


def response_tokens(record: TreeRecord, leaf: int) -> int:
    return sum(len(record.nodes[i].step.action_ids) for i in record.path(leaf))


def _reward(record, leaf, config) -> float:
    penalty = overlong_penalty(response_tokens(record, leaf), max_response_tokens(config),
                               int(config.rl.dapo.overlong_cache))
    return outcome_reward(record, leaf) + penalty


def check_config(config) -> None:
    """Dynamic sampling's round cap and the overlong cache, checked before the first rollout."""
    s = config.rl.dapo
    if int(s.max_sampling_rounds) < 1:
        raise ConfigError(f"config.rl.dapo.max_sampling_rounds must be >= 1, got {s.max_sampling_rounds}")
    limit = max_response_tokens(config)
    if not 1 <= int(s.overlong_cache) <= limit:
        raise ConfigError(f"config.rl.dapo.overlong_cache must be in [1, {limit}] (the maximum response length: "
                         f"rl.dapo.max_response_tokens, or rollout.max_steps x rollout.max_new_tokens), "
                         f"got {s.overlong_cache}")


def keep_group(record: TreeRecord, config) -> bool:
    """Dynamic sampling: keep a query only if its trajectories' R_out are not all equal."""
    return len({record.leaf_outcomes[str(leaf)] for leaf in record.leaves()}) > 1


DAPO = Algorithm("dapo", "group", group_builder("dapo", _reward), grpo_loss("dapo"), keep=keep_group,
                 check=check_config)
