"""Judges: rule judges (rules.py) and model judges (process GOOD/BAD, outcome YES/NO, PORTool's
true/false/unable_to_answer) over a local model or an OpenAI-compatible endpoint, with majority vote
and an on-disk cache. Build one from a config with `build_judge(config, role)`.

The local backend (`steprl_jax.judges.local_backend`) imports JAX; it is loaded only when used.
"""
from steprl_jax.judges.backends import BackendError, CachedBackend, ChatBackend
from steprl_jax.judges.cache import ReplyCache
from steprl_jax.judges.factory import build_backend, build_judge
from steprl_jax.judges.http_backend import HttpChatBackend
from steprl_jax.judges.items import (OutcomeItem, StepItem, TrajectoryItem, outcome_item, step_items,
                                     step_messages, trajectory_item)
from steprl_jax.judges.model_judges import JudgeStats, OutcomeJudge, ProcessJudge, TrajectoryVerdictJudge
from steprl_jax.judges.rule_judges import RuleOutcomeJudge, RuleProcessJudge, RuleTrajectoryJudge
from steprl_jax.judges.verdicts import Verdict, majority, parse_label

__all__ = [
    "BackendError", "CachedBackend", "ChatBackend", "HttpChatBackend", "JudgeStats", "OutcomeItem", "OutcomeJudge",
    "ProcessJudge", "ReplyCache", "RuleOutcomeJudge", "RuleProcessJudge", "RuleTrajectoryJudge", "StepItem",
    "TrajectoryItem", "TrajectoryVerdictJudge", "Verdict", "build_backend", "build_judge", "majority", "outcome_item",
    "parse_label", "step_items", "step_messages", "trajectory_item",
]

# SWiRL's stage-2 reward model R(a | s): rule | local | http, binary or graded.
from steprl_jax.judges.rewards import (ModelRewardModel, Reward, RewardItem, RewardModel, RewardStats,  # noqa: E402
                                       RuleRewardModel, build_reward_model)

__all__ += ["ModelRewardModel", "Reward", "RewardItem", "RewardModel", "RewardStats", "RuleRewardModel",
            "build_reward_model"]
