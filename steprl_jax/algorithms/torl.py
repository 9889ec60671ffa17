"""ToRL (Li et al. 2025, "ToRL: Scaling Tool-Integrated RL"; reference GAIR-NLP/ToRL,
scripts/torl_1.5b.sh): GRPO on tool-integrated reasoning in the code format (agents/code_env.py:
python blocks run in the sandbox at ```output, the answer in \\boxed{}).

* n independent responses per query (the `group` schedule; ToRL: 16);
* reward R_out = +1 when math-verify finds the response's last \\boxed{} equal to the reference,
  -1 when it is wrong or missing (the outcome rule of agents/tasks.py; no formatting reward, no
  execution penalty, ToRL's default);
* advantage: the group z-score of the reward on every generated token of the response
  ((r - mean) / (std + 1e-6), torch.std: ddof 1), tool outputs masked;
* loss: the clipped surrogate with a symmetric clip 0.2, no KL, no entropy term, token-level
  aggregation: verl's masked token mean at ToRL's version (`rl.torl.agg` token_mean).
"""
from __future__ import annotations

from steprl_jax.algorithms.base import Algorithm
from steprl_jax.algorithms.grpo import GroupMethodSettings, group_builder, group_loss, outcome_only, read_group


def read(config) -> GroupMethodSettings:
    return GroupMethodSettings(**read_group(config, "torl"))  # rl.torl has no kl_coef: 0


TORL = Algorithm("torl", "torl", "group", read, group_builder(outcome_only), group_loss, formats=("code",))
