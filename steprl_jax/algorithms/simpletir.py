"""SimpleTIR (Xue et al. 2025, "SimpleTIR: End-to-End RL for Multi-Turn Tool-Integrated
Reasoning"; reference ltzheng/SimpleTIR, recipe/simpletir): GRPO on multi-turn tool-integrated
reasoning in the code_turns format (agents/code_env.py `CodeTurnsEnv`: each turn ends at its first
complete code block, which runs in the sandbox; the answer in \\boxed{}), with void turns masked.

* n independent responses per query (the `group` schedule; SimpleTIR: 16);
* reward 1 when math-verify finds the response's last \\boxed{} equal to the reference, else 0
  (SimpleTIR's math_verify reward manager; its fallbacks to "the answer is" and the last number
  of the text are not copied: the outcome rule is the code format's, agents/tasks.py);
* advantage: the group z-score of the reward on every generated token of the response
  ((r - mean) / (std + 1e-6), torch.std: ddof 1), tool outputs masked;
* void-turn masking (`mask_void_turns`): a trajectory holding a void turn (neither a complete
  block nor \\boxed{}) trains no token, while its reward still counts in its group's mean and std
  (SimpleTIR zeroes its loss mask; GRPO there normalises over the response mask);
* group filtering (`keep`, re-sampled like DAPO's dynamic sampling, at most `max_sampling_rounds`
  rounds; SimpleTIR oversamples 2-3x instead): a group whose rewards' std < `min_std` (1e-3) is
  dropped, and so is one whose every response was truncated (dapo.truncated: cut by the
  context, or its last turn cut at rollout.max_new_tokens; SimpleTIR compares each response's
  length with the batch's padded width). SimpleTIR's optional accuracy band and `remove_clip`
  are not built;
* loss: the clipped surrogate with eps_low 0.2, eps_high 0.28 and dual clip c = 3 (negative
  advantages only, ops/losses.py), no KL, no entropy term, verl's masked token mean
  (`rl.simpletir.agg` token_mean; the paper writes a per-sequence mean, the code a token mean).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from steprl_jax.agents.code_env import VOID_TURN
from steprl_jax.agents.records import TreeRecord
from steprl_jax.algorithms.base import Algorithm
from steprl_jax.algorithms.dapo import truncated
from steprl_jax.algorithms.grpo import GroupMethodSettings, group_builder, outcome_reward, read_group
from steprl_jax.errors import ConfigError
from steprl_jax.training.config import LossConfig


@dataclasses.dataclass(frozen=True)
class SimpleTirSettings(GroupMethodSettings):
    dual_clip: float = 3.0
    mask_void_turns: bool = True
    min_std: float = 1e-3
    max_sampling_rounds: int = 1


def solved(record: TreeRecord, leaf: int, s=None) -> float:
    """SimpleTIR's reward: 1 for a correct final answer, else 0 (R_out +1 -> 1; -1 and 0 -> 0)."""
    return 1.0 if outcome_reward(record, leaf) > 0 else 0.0


def has_void_turn(record: TreeRecord, leaf: int) -> bool:
    return any(record.nodes[i].step.kind == VOID_TURN for i in record.path(leaf))


def _masked(record: TreeRecord, leaf: int, s: SimpleTirSettings) -> bool:
    return s.mask_void_turns and has_void_turn(record, leaf)


def keep_group(record: TreeRecord, s: SimpleTirSettings) -> bool:
    """SimpleTIR's group filter: keep a query whose rewards vary (std >= min_std) and which has at
    least one response not truncated."""
    rewards = [solved(record, leaf) for leaf in record.leaves()]
    if float(np.std(rewards)) < s.min_std:
        return False
    return not all(truncated(record, leaf) for leaf in record.leaves())


def read(config) -> SimpleTirSettings:
    s = config.rl.simpletir
    if not float(s.dual_clip) > 1.0:
        raise ConfigError(f"config.rl.simpletir.dual_clip must be > 1 (the cap -c*A on negative advantages), "
                          f"got {s.dual_clip}")
    if not float(s.min_std) >= 0.0:
        raise ConfigError(f"config.rl.simpletir.min_std must be >= 0, got {s.min_std}")
    if int(s.max_sampling_rounds) < 1:
        raise ConfigError(f"config.rl.simpletir.max_sampling_rounds must be >= 1, got {s.max_sampling_rounds}")
    return SimpleTirSettings(**read_group(config, "simpletir"), dual_clip=float(s.dual_clip),
                             mask_void_turns=bool(s.mask_void_turns), min_std=float(s.min_std),
                             max_sampling_rounds=int(s.max_sampling_rounds))


def loss(s: SimpleTirSettings) -> LossConfig:
    return LossConfig(kind="policy", agg="token_mean", eps_low=s.eps_low, eps_high=s.eps_high, dual_clip=s.dual_clip,
                      kl_coef=0.0, temperature=s.temperature)


SIMPLETIR = Algorithm("simpletir", "simpletir", "group", read, group_builder(solved, masked=_masked), loss,
                      keep=keep_group, sampling_rounds=lambda s: s.max_sampling_rounds, formats=("code_turns",))
