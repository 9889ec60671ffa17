"""The on-policy algorithms the online loop (algorithms/online.py) runs, registered by name.

An algorithm is a rollout mode, a batch builder and its loss settings; nothing subclasses a
trainer. A new method is one module and one line in `ALGORITHMS`.

    rollout   "tree" (PORTool trees), "group" (n independent trajectories) or "arpo"
              (entropy-driven branching after tool calls); every mode yields TreeRecords
    build     (judged trees, config) -> (rows for training/pack.py, metrics)
    loss      config -> LossConfig (the builder's token weights implement the aggregation,
              so the train step always runs the token_mean kernel)
    keep      optional (judged tree, config) -> bool: dynamic sampling (DAPO) keeps a query's
              group only when it is informative
    check     optional config -> None: the algorithm's own settings, checked before the first
              rollout (raises ValueError naming the field)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from steprl_jax.errors import ConfigError

ROLLOUT_MODES = ("tree", "group", "arpo")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str
    rollout: str
    build: Callable
    loss: Callable
    keep: Optional[Callable] = None
    check: Optional[Callable] = None

    def __post_init__(self):
        if self.rollout not in ROLLOUT_MODES:
            raise ValueError(f"algorithm {self.name}: rollout mode {self.rollout!r} is not one of {ROLLOUT_MODES}")


def policy_temperature(config) -> float:
    """The one temperature field: the rollout samples at it and the loss uses it (greedy decoding,
    temperature 0, records log-probs at 1)."""
    t = float(config.rollout.temperature)
    return t if t > 0 else 1.0


def _registry() -> dict:
    from steprl_jax.algorithms import arpo, dapo, grpo, portool

    return {a.name: a for a in (portool.PORTOOL, grpo.GRPO, grpo.GRPO_FM, dapo.DAPO, arpo.ARPO, arpo.ARPO_FM)}


ALGORITHMS = ("portool", "grpo", "grpo_fm", "dapo", "arpo", "arpo_fm")


def get_algorithm(name: str) -> Algorithm:
    registry = _registry()
    if name not in registry:
        raise ConfigError(f"config.algorithm: unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    return registry[name]
