"""ARPO (Dong et al. 2025), a PORTool baseline: entropy-based adaptive branching after tool calls
(`RolloutEngine.run_arpo`, settings in `config.rl.arpo`), then GRPO advantages over the final
trajectories (`config.rl.grpo`); a prefix shared by several trajectories is trained once per
trajectory with each one's advantage, as separate sequences would be. arpo_fm adds R_fm to the
trajectory reward as grpo_fm does."""
from __future__ import annotations

from steprl_jax.algorithms import grpo
from steprl_jax.algorithms.rl import Algorithm

ARPO = Algorithm("arpo", "arpo", grpo.group_builder("grpo", grpo.outcome_only), grpo.grpo_loss("grpo"))
ARPO_FM = Algorithm("arpo_fm", "arpo", grpo.group_builder("grpo", grpo.outcome_plus_fm), grpo.grpo_loss("grpo"))
