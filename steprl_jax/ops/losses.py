"""Per-token loss kernels that return `(loss_sum, denominator)`, never a mean.

The division happens once, at the very end of a train step, by the denominator of the whole
(global) batch. Because every denominator below depends only on the mask, never on the
parameters, gradient accumulation and data-parallel sums stay exactly equal to one big batch
for every aggregation mode.

Aggregation modes (verl's `agg_loss` names with `_` instead of `-`), loss_bt masked by mask_bt:

  token_mean               sum_bt l*m / sum_bt m                       (DAPO, PORTool)
  seq_mean_token_mean      sum_b (sum_t l*m / sum_t m) / n_rows         (GRPO)
  seq_mean_token_sum       sum_bt l*m / n_rows
  seq_mean_token_sum_norm  sum_bt l*m / (n_rows * H), H = `norm` or padded length T  (Dr. GRPO)

`n_rows` counts the rows that select at least one token, so all-padding rows (needed for fixed
shapes) change nothing; verl's engine divides by its global batch size, which counts every row.
seq_mean_token_sum_norm follows verl >= 0.7.1 (same in 0.9): row sums / rows / H; verl <= 0.7.0
divided by H only, a scale that grew with the batch. A zero denominator gives a zero loss, not NaN
(see `safe_divide`).

Sign convention: every `*_loss` returns a quantity to MINIMISE.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

# log-ratio clamp before exp: keeps one wild token from producing inf (verl uses the same bound).
_LOG_RATIO_CLAMP = 20.0


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg mode {agg!r}; expected one of {AGG_MODES}")


def _check_shapes(**arrays) -> None:
    shapes = {k: tuple(v.shape) for k, v in arrays.items() if v is not None}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes disagree: {shapes}")
    (shape,) = set(shapes.values())
    if len(shape) != 2:
        raise ValueError(f"expected [batch, length] arrays, got shape {shape}")


def agg_denominator(mask_bt: jax.Array, agg: str, *, norm: Optional[float] = None) -> jax.Array:
    """The float32 denominator of `agg` for this mask (a function of the mask only)."""
    _check_agg(agg)
    m = mask_bt.astype(jnp.float32)
    if agg == "token_mean":
        return jnp.sum(m)
    n_rows = jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))
    if agg == "seq_mean_token_sum_norm":
        return n_rows * _horizon(mask_bt, norm)
    return n_rows


def _horizon(mask_bt: jax.Array, norm: Optional[float]) -> jax.Array:
    """The per-row constant H of seq_mean_token_sum_norm: `norm`, or the padded length T."""
    if norm is None:
        return jnp.float32(mask_bt.shape[-1])
    if not norm > 0:
        raise ValueError(f"norm (the seq_mean_token_sum_norm horizon) must be > 0, got {norm}")
    return jnp.float32(norm)


def agg_sum(loss_bt: jax.Array, mask_bt: jax.Array, agg: str) -> jax.Array:
    """The float32 numerator of `agg`: additive over rows (hence over micro-batches/shards)."""
    _check_agg(agg)
    m = mask_bt.astype(jnp.float32)
    masked = jnp.where(m > 0, loss_bt.astype(jnp.float32), 0.0) * m
    if agg == "seq_mean_token_mean":
        row_sum = jnp.sum(masked, axis=-1)
        row_count = jnp.sum(m, axis=-1)
        return jnp.sum(row_sum / jnp.maximum(row_count, 1.0))
    return jnp.sum(masked)


def aggregate(loss_bt, mask_bt, agg: str, *, norm: Optional[float] = None):
    """`(sum, denominator)` of a per-token loss under aggregation mode `agg`."""
    _check_shapes(loss=loss_bt, mask=mask_bt)
    return agg_sum(loss_bt, mask_bt, agg), agg_denominator(mask_bt, agg, norm=norm)


def safe_divide(total: jax.Array, denominator: jax.Array) -> jax.Array:
    """total / denominator, and 0 where the denominator is 0 (an empty batch adds no loss)."""
    ok = denominator > 0
    return jnp.where(ok, total / jnp.where(ok, denominator, 1.0), 0.0)


def _check_clip(eps_low, eps_high, dual_clip) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")


def policy_loss(logp_bt, old_logp_bt, advantages_bt, mask_bt, *, eps_low: float,
                eps_high: float, dual_clip: Optional[float] = None, agg: str = "token_mean",
                norm: Optional[float] = None,
                is_weight_bt: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array, Dict[str, jax.Array]]:
    """PPO/GRPO clipped surrogate, per token, aggregated as `(loss_sum, denominator, metrics)`.

    Per token: r = exp(logp - old_logp), loss = max(-A r, -A clip(r, 1-eps_low, 1+eps_high));
    with `dual_clip=c` the loss of a token with A < 0 is also capped at -c A. `is_weight_bt`
    (off-policy correction, `truncated_is_weights`): each token's loss times its weight, which
    carries no gradient.

    `metrics` holds token SUMS (over the masked tokens) plus `token_count`, `ratio_max` and
    `ratio_min`; `finalize_metrics` turns them into means. Keys: clipfrac (the clipped term is
    active), clipfrac_dual, approx_kl (old_logp - logp, verl's ppo_kl), ratio.
    """
    _check_shapes(logp=logp_bt, old_logp=old_logp_bt, advantages=advantages_bt, mask=mask_bt)
    _check_clip(eps_low, eps_high, dual_clip)
    m = mask_bt.astype(jnp.float32)
    adv = advantages_bt.astype(jnp.float32)
    log_ratio = jnp.clip(logp_bt - old_logp_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    dual_active = jnp.zeros_like(loss, dtype=bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
    if is_weight_bt is not None:
        _check_shapes(logp=logp_bt, is_weight=is_weight_bt)
        loss = loss * jax.lax.stop_gradient(is_weight_bt.astype(jnp.float32))
    total, denom = aggregate(loss, mask_bt, agg, norm=norm)

    on = m > 0
    ratio_ng = jax.lax.stop_gradient(ratio)
    metrics = {
        "clipfrac": jnp.sum(jnp.where(on, clipped > unclipped, False).astype(jnp.float32)),
        "clipfrac_dual": jnp.sum(jnp.where(on, dual_active, False).astype(jnp.float32)),
        "approx_kl": jnp.sum(jnp.where(on, jax.lax.stop_gradient(-log_ratio), 0.0)),
        "ratio": jnp.sum(jnp.where(on, ratio_ng, 0.0)),
        "token_count": jnp.sum(on.astype(jnp.float32)),  # tokens, not weights: means of fractional masks
        "ratio_max": jnp.max(jnp.where(on, ratio_ng, -jnp.inf)),
        "ratio_min": jnp.min(jnp.where(on, ratio_ng, jnp.inf)),
    }
    return total, denom, metrics


def truncated_is_weights(proximal_logp_bt, behaviour_logp_bt, mask_bt, cap: float):
    """Decoupled PPO's behaviour correction (AReaL; verl's token-level truncated IS): per token
    w = min(exp(log pi_prox - log pi_behav), cap), 0 off the mask. pi_behav sampled the token
    (the sampler's recorded log-prob, possibly some versions old), pi_prox is the learner's
    policy when the update starts; the surrogate clips r = pi / pi_prox and is weighted by w.
    Returns (weights [B, L], metric sums: is_weight, is_truncated, is_weight_max, token_count)."""
    _check_shapes(proximal=proximal_logp_bt, behaviour=behaviour_logp_bt, mask=mask_bt)
    if not cap > 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    on = mask_bt > 0
    log_w = jnp.clip(proximal_logp_bt - behaviour_logp_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    raw = jnp.exp(log_w.astype(jnp.float32))
    weights = jnp.where(on, jnp.minimum(raw, cap), 0.0)
    sums = {"is_weight": jnp.sum(weights),
            "is_truncated": jnp.sum((on & (raw > cap)).astype(jnp.float32)),
            "is_weight_max": jnp.max(jnp.where(on, raw, -jnp.inf)),
            "token_count": jnp.sum(on.astype(jnp.float32))}
    return weights, sums


def finalize_metrics(metric_sums: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """Token sums -> token means (keys ending in _max/_min and token_count pass through)."""
    count = metric_sums["token_count"]
    out = {}
    for k, v in metric_sums.items():
        if k == "token_count" or k.endswith("_max") or k.endswith("_min"):
            out[k] = v
        else:
            out[k] = safe_divide(v, count)
    return out


def empty_metrics(like: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """The identity of `combine_metrics` shaped like `like`: 0 for sums, -inf for _max, +inf for _min."""
    def empty(k, x):
        fill = -jnp.inf if k.endswith("_max") else jnp.inf if k.endswith("_min") else 0
        return jnp.full(x.shape, fill, x.dtype)
    return {k: empty(k, x) for k, x in like.items()}


def combine_metrics(a: Dict[str, jax.Array], b: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    """Merge two metric-sum dicts (micro-batches): sums add, _max/_min reduce."""
    out = {}
    for k in a:
        if k.endswith("_max"):
            out[k] = jnp.maximum(a[k], b[k])
        elif k.endswith("_min"):
            out[k] = jnp.minimum(a[k], b[k])
        else:
            out[k] = a[k] + b[k]
    return out


# ---- KL to a frozen reference policy -------------------------------------------------------
def kl_k1(logp_bt, ref_logp_bt):
    """log pi - log pi_ref: unbiased, high variance, can be negative."""
    return logp_bt - ref_logp_bt


def kl_k2(logp_bt, ref_logp_bt):
    """0.5 (log pi - log pi_ref)^2: biased, low variance, its gradient is the KL's."""
    return 0.5 * jnp.square(logp_bt - ref_logp_bt)


def kl_k3(logp_bt, ref_logp_bt):
    """exp(d) - d - 1 with d = log pi_ref - log pi: unbiased, low variance, >= 0 ('low_var_kl')."""
    d = jnp.clip(ref_logp_bt - logp_bt, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.exp(d) - d - 1.0


KL_ESTIMATORS: Dict[str, Callable] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_loss(logp_bt, ref_logp_bt, mask_bt, *, estimator: str = "k3", agg: str = "token_mean",
            norm: Optional[float] = None):
    """`(sum, denominator)` of the per-token KL estimate to the reference policy."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of "
                         f"{tuple(KL_ESTIMATORS)}")
    _check_shapes(logp=logp_bt, ref_logp=ref_logp_bt, mask=mask_bt)
    return aggregate(KL_ESTIMATORS[estimator](logp_bt, ref_logp_bt), mask_bt, agg, norm=norm)


def sft_loss(logp_bt, mask_bt, *, agg: str = "token_mean", norm: Optional[float] = None):
    """`(sum, denominator)` of the negative log-likelihood of the masked tokens."""
    _check_shapes(logp=logp_bt, mask=mask_bt)
    return aggregate(-logp_bt, mask_bt, agg, norm=norm)


def entropy_bonus(entropy_bt, mask_bt, *, agg: str = "token_mean",
                  norm: Optional[float] = None):
    """`(sum, denominator)` of the entropy; the caller SUBTRACTS coef * this from its loss."""
    _check_shapes(entropy=entropy_bt, mask=mask_bt)
    return aggregate(entropy_bt, mask_bt, agg, norm=norm)
