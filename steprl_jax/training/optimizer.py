"""optax optimizer: global-norm clipping, AdamW, warmup + cosine schedule."""
from __future__ import annotations

import jax
import optax

from steprl_jax.training.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    if cfg.warmup_steps == 0:
        return optax.cosine_decay_schedule(cfg.learning_rate, cfg.total_steps,
                                           alpha=cfg.end_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.end_lr_ratio)


def _decay_mask(params):
    """Decay matrices only: no weight decay on norms and biases (by parameter path)."""
    def keep(path, _):
        name = jax.tree_util.keystr(path)
        return not ("norm" in name or "bias" in name)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=_decay_mask))
    return optax.chain(*parts)
