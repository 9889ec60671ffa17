"""The contract every on-policy method fills, and the registry the online loop finds them in.

A method is a module (algorithms/<method>.py) defining an `Algorithm`; nothing subclasses a trainer
and the loop (algorithms/online.py) never names a method. Adding one touches its module, one line
of `ALGORITHMS` below, its config section (configs/, config_schema.py) and its tests.

    name        what `config.algorithm` says
    section     its settings' section, `config.rl.<section>`
    schedule    the rollout schedule by name (agents/schedules: group, tree, arpo, ...)
    read        config -> its frozen settings (the only place the method reads the ConfigDict; it
                raises ConfigError naming the field); `settings.rollout` is the schedule's settings
    build       (judged trees, settings) -> (rows for training/pack.py, metrics)
    loss        settings -> LossConfig (the builder's token weights implement the aggregation, so the
                train step always runs the token_mean kernel)
    keep        optional (judged tree, settings) -> bool: dynamic sampling (DAPO) keeps a query's
                group only when it is informative
    sampling_rounds  settings -> how many rounds of queries the loop may roll out to fill a batch
                whose groups `keep` dropped (1 without `keep`)
    formats     the action formats (`config.env.format`) the method trains on: "tool_call"
                (PORTool's think + tool_call steps, R_fm, response_gen) by default; "code" (ToRL's
                python blocks run at ```output, agents/code_env.py); "code_turns"
                (SimpleTIR's turns ending at the first complete code block); "flow"
                (AgentFlow's planner calls, each a fresh prompt, around frozen modules:
                agents/flow.py)
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional

from steprl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    section: str
    schedule: str
    read: Callable[[Any], Any]
    build: Callable
    loss: Callable
    keep: Optional[Callable] = None
    sampling_rounds: Callable[[Any], int] = lambda settings: 1
    formats: tuple = ("tool_call",)


def policy_temperature(config) -> float:
    """The one temperature field: the rollout samples at it and the loss uses it (greedy decoding,
    temperature 0, records log-probs at 1)."""
    t = float(config.rollout.temperature)
    return t if t > 0 else 1.0


# name -> "module:attribute" under steprl_jax.algorithms; looked up when asked for, so the method
# modules import this one and not the other way round.
ALGORITHMS = {
    "portool": "portool:PORTOOL",
    "grpo": "grpo:GRPO",
    "grpo_fm": "grpo:GRPO_FM",
    "dapo": "dapo:DAPO",
    "arpo": "arpo:ARPO",
    "arpo_fm": "arpo:ARPO_FM",
    "gigpo": "gigpo:GIGPO",
    "tree_grpo": "tree_grpo:TREE_GRPO",
    "torl": "torl:TORL",
    "simpletir": "simpletir:SIMPLETIR",
    "flow_grpo": "flow_grpo:FLOW_GRPO",
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError(f"config.algorithm: unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    module, attribute = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(f"steprl_jax.algorithms.{module}"), attribute)
