"""Loss kernels against an independent NumPy implementation (verl agg_loss semantics)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.ops import losses
from steprl_jax.ops.losses import AGG_MODES, policy_loss, safe_divide


def np_agg(loss, mask, agg, norm=None):
    loss = np.asarray(loss, np.float64)
    mask = np.asarray(mask, np.float64)
    rows = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    if agg == "token_mean":
        return (loss * mask).sum() / mask.sum()
    if agg == "seq_mean_token_sum":
        return np.mean([(loss[i] * mask[i]).sum() for i in rows])
    if agg == "seq_mean_token_mean":
        return np.mean([(loss[i] * mask[i]).sum() / mask[i].sum() for i in rows])
    if agg == "seq_mean_token_sum_norm":
        horizon = loss.shape[1] if norm is None else norm
        return np.mean([(loss[i] * mask[i]).sum() for i in rows]) / horizon
    raise AssertionError(agg)


def np_verl_sum_norm(loss_mat, loss_mask, loss_scale_factor=None, dp_size=1,
                     global_batch_size=None):
    """verl (v0.7.1 .. v0.9.0) core_algos.agg_loss, mode "seq-mean-token-sum-norm", in NumPy."""
    loss_mat = np.asarray(loss_mat, np.float64)
    loss_mask = np.asarray(loss_mask, np.float64)
    seq_losses = np.sum(loss_mat * loss_mask, axis=-1)
    seq_mask = (np.sum(loss_mask, axis=-1) > 0).astype(np.float64)
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    loss = np.sum(seq_losses * seq_mask) / global_batch_size * dp_size
    if loss_scale_factor is None:
        loss_scale_factor = loss_mask.shape[-1]
    return loss / loss_scale_factor


def np_ppo(logp, old, adv, eps_low, eps_high, dual=None):
    r = np.exp(np.asarray(logp, np.float64) - np.asarray(old, np.float64))
    adv = np.asarray(adv, np.float64)
    out = np.empty_like(r)
    for idx in np.ndindex(r.shape):
        a, ri = adv[idx], r[idx]
        val = max(-a * ri, -a * min(max(ri, 1 - eps_low), 1 + eps_high))
        if dual is not None and a < 0:
            val = min(val, -a * dual)
        out[idx] = val
    return out


def _batch(seed=0, b=5, t=9):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    adv = rng.normal(0, 1.0, (b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    mask[2] = 0.0  # an all-padding row
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_numpy(agg, dual):
    logp, old, adv, mask = _batch()
    total, denom, metrics = jax.jit(
        lambda *a: policy_loss(*a, eps_low=0.2, eps_high=0.28, dual_clip=dual, agg=agg))(
            logp, old, adv, mask)
    expected = np_agg(np_ppo(logp, old, adv, 0.2, 0.28, dual), mask, agg)
    np.testing.assert_allclose(total / denom, expected, rtol=1e-5)
    r = np.exp(logp - old)
    on = mask > 0
    clipped_active = (-adv * np.clip(r, 0.8, 1.28)) > (-adv * r)
    fin = losses.finalize_metrics(metrics)
    np.testing.assert_allclose(fin["clipfrac"], clipped_active[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(fin["approx_kl"], (old - logp)[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(fin["ratio"], r[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(fin["ratio_max"], r[on].max(), rtol=1e-6)
    np.testing.assert_allclose(fin["ratio_min"], r[on].min(), rtol=1e-6)


def test_seq_mean_token_sum_norm_custom_constant():
    logp, old, adv, mask = _batch(1)
    total, denom, _ = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2,
                                  agg="seq_mean_token_sum_norm", norm=512.0)
    np.testing.assert_allclose(total / denom,
                               np_agg(np_ppo(logp, old, adv, .2, .2), mask,
                                      "seq_mean_token_sum_norm", 512.0), rtol=1e-5)


@pytest.mark.parametrize("norm", [None, 512.0])
def test_seq_mean_token_sum_norm_matches_verl(norm):
    rng = np.random.default_rng(7)
    loss = rng.normal(0, 1.0, (6, 11)).astype(np.float32)
    mask = (rng.random((6, 11)) < 0.5).astype(np.float32)
    mask[0, :2] = 1.0
    mask[3] = 0.0  # an all-zero row: not counted by either
    total, denom = losses.aggregate(loss, mask, "seq_mean_token_sum_norm", norm=norm)
    np.testing.assert_allclose(float(denom), 5 * (11 if norm is None else norm), rtol=0)
    np.testing.assert_allclose(total / denom, np_verl_sum_norm(loss, mask, norm), rtol=1e-6)
    # verl over 2 data-parallel ranks with the global row count, after FSDP's gradient mean
    halves = [np_verl_sum_norm(loss[s], mask[s], norm, dp_size=2, global_batch_size=5)
              for s in (slice(0, 3), slice(3, 6))]
    np.testing.assert_allclose(total / denom, np.mean(halves), rtol=1e-6)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_microbatch_split_equals_whole(agg):
    rng = np.random.default_rng(8)
    loss = rng.normal(0, 1.0, (8, 7)).astype(np.float32)
    mask = (rng.random((8, 7)) < 0.6).astype(np.float32)
    mask[1] = 0.0
    mask[6] = 0.0
    whole = losses.agg_sum(loss, mask, agg) / losses.agg_denominator(mask, agg, norm=64.0)
    parts = sum(losses.agg_sum(loss[i:i + 3], mask[i:i + 3], agg) for i in (0, 3, 6))
    np.testing.assert_allclose(parts / losses.agg_denominator(mask, agg, norm=64.0), whole,
                               rtol=1e-6)
    np.testing.assert_allclose(whole, np_agg(loss, mask, agg, 64.0), rtol=1e-5)


def test_gradient_of_policy_loss():
    """d loss / d logp = -A r where unclipped is active, 0 where clipped (token_mean)."""
    logp, old, adv, mask = _batch(2)
    g = jax.grad(lambda lp: safe_divide(*policy_loss(lp, old, adv, mask, eps_low=.2,
                                                      eps_high=.2)[:2]))(jnp.asarray(logp))
    r = np.exp(logp - old)
    active = (-adv * r) >= (-adv * np.clip(r, .8, 1.2))
    expected = np.where(active & (mask > 0), -adv * r, 0.0) / mask.sum()
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def test_ratio_one_means_no_clipping():
    logp, _, adv, mask = _batch(3)
    _, _, m = policy_loss(logp, logp, adv, mask, eps_low=.2, eps_high=.2)
    fin = losses.finalize_metrics(m)
    assert float(fin["clipfrac"]) == 0.0 and float(fin["ratio"]) == pytest.approx(1.0)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_kl_estimators(est, agg):
    logp, ref, _, mask = _batch(4)
    d = np.asarray(logp, np.float64) - ref
    per_tok = {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) + d - 1}[est]
    total, denom = losses.kl_loss(logp, ref, mask, estimator=est, agg=agg)
    np.testing.assert_allclose(total / denom, np_agg(per_tok, mask, agg), rtol=1e-5)


def test_sft_and_entropy():
    logp, _, ent, mask = _batch(5)
    total, denom = losses.sft_loss(logp, mask, agg="seq_mean_token_mean")
    np.testing.assert_allclose(total / denom, np_agg(-logp, mask, "seq_mean_token_mean"),
                               rtol=1e-5)
    total, denom = losses.entropy_bonus(np.abs(ent), mask)
    np.testing.assert_allclose(total / denom, np_agg(np.abs(ent), mask, "token_mean"), rtol=1e-5)


def test_zero_denominator_gives_zero_not_nan():
    logp, old, adv, mask = _batch(6)
    for agg in AGG_MODES:
        total, denom, m = policy_loss(logp, old, adv, np.zeros_like(mask), eps_low=.2,
                                      eps_high=.2, agg=agg)
        val = safe_divide(total, denom)
        assert float(val) == 0.0
        assert np.isfinite(float(losses.finalize_metrics(m)["clipfrac"]))
    g = jax.grad(lambda lp: safe_divide(*policy_loss(lp, old, adv, 0 * mask, eps_low=.2,
                                                      eps_high=.2)[:2]))(jnp.asarray(logp))
    assert np.all(np.asarray(g) == 0.0)


def test_bad_input():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="shapes disagree"):
        policy_loss(logp, old[:, :3], adv, mask, eps_low=.2, eps_high=.2)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logp, old, adv, mask, eps_low=1.0, eps_high=.2)
    with pytest.raises(ValueError, match="eps_high"):
        policy_loss(logp, old, adv, mask, eps_low=.2, eps_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, eps_low=.2, eps_high=.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(logp, old, adv, mask, eps_low=.2, eps_high=.2, agg="mean")
    with pytest.raises(ValueError, match="norm"):
        policy_loss(logp, old, adv, mask, eps_low=.2, eps_high=.2, agg="seq_mean_token_sum_norm",
                    norm=0.0)
    with pytest.raises(ValueError, match="KL estimator"):
        losses.kl_loss(logp, old, mask, estimator="k4")
