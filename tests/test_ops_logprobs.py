"""Chunked log-probs equal the naive [B, T, V] path, values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.ops.logprobs import naive_token_logprobs, token_logprobs


def _inputs(b=3, t=37, d=16, v=53, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(k1, (b, t, d), jnp.float32)
    w = jax.random.normal(k2, (v, d), jnp.float32) * 0.5
    y = jax.random.randint(k3, (b, t), 0, v)
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 8, 16, 37, 64])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 5.0)])
def test_chunked_equals_naive(chunk, temperature, softcap):
    h, w, y = _inputs()
    lp, ent = token_logprobs(h, w, y, temperature=temperature, final_softcap=softcap,
                             chunk_size=chunk, with_entropy=True)
    lp_ref, ent_ref = naive_token_logprobs(h, w, y, temperature=temperature,
                                           final_softcap=softcap, with_entropy=True)
    assert lp.dtype == jnp.float32 and lp.shape == y.shape
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, ent_ref, rtol=1e-6, atol=1e-6)


def test_matches_numpy_log_softmax_with_temperature():
    h, w, y = _inputs(b=2, t=5)
    temp, cap = 0.8, 3.0
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    z = cap * np.tanh(logits / cap) / temp
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = np.take_along_axis(logsm, np.asarray(y)[..., None], -1)[..., 0]
    p = np.exp(logsm)
    expected_ent = -(p * logsm).sum(-1)
    lp, ent = token_logprobs(h, w, y, temperature=temp, final_softcap=cap, chunk_size=2,
                             with_entropy=True)
    np.testing.assert_allclose(lp, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, expected_ent, rtol=1e-5, atol=1e-5)


def test_gradients_equal_naive():
    h, w, y = _inputs()
    g_bt = jax.random.normal(jax.random.PRNGKey(5), y.shape)

    def loss(fn, h, w, **kw):
        lp, ent = fn(h, w, y, with_entropy=True, temperature=0.9, **kw)
        return jnp.sum(lp * g_bt) + 0.3 * jnp.sum(ent)

    gh, gw = jax.grad(lambda h, w: loss(token_logprobs, h, w, chunk_size=8), (0, 1))(h, w)
    gh_ref, gw_ref = jax.grad(lambda h, w: loss(naive_token_logprobs, h, w), (0, 1))(h, w)
    np.testing.assert_allclose(gh, gh_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_decode_shape_and_bf16_compute():
    h, w, y = _inputs(b=4, t=1)
    lp = jax.jit(token_logprobs)(h, w, y)
    assert lp.shape == (4, 1)
    lp16 = token_logprobs(h, w, y, compute_dtype=jnp.bfloat16)
    assert lp16.dtype == jnp.float32
    np.testing.assert_allclose(lp16, lp, atol=0.1)


def test_no_full_logits_in_backward():
    """No [B, T, V] float32 buffer appears in the compiled forward+backward program."""
    b, t, d, v = 2, 256, 8, 512
    h, w, y = _inputs(b=b, t=t, d=d, v=v)
    f = jax.jit(jax.grad(lambda h, w: jnp.sum(token_logprobs(h, w, y, chunk_size=32)), (0, 1)))
    hlo = f.lower(h, w).compile().as_text()
    assert f"f32[{b},{t},{v}]" not in hlo
    naive = jax.jit(jax.grad(lambda h, w: jnp.sum(naive_token_logprobs(h, w, y)), (0, 1)))
    assert f"f32[{b},{t},{v}]" in naive.lower(h, w).compile().as_text()


def test_bad_inputs():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="targets_bt shape"):
        token_logprobs(h, w, y[:, :3])
    with pytest.raises(ValueError, match="hidden size"):
        token_logprobs(h, w[:, :3], y)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(h, w, y.astype(jnp.float32))


def test_automatic_chunk_size_fits_the_budget():
    from steprl_jax.ops.logprobs import DEFAULT_CHUNK_BYTES, auto_chunk_size
    assert auto_chunk_size(2, 512, 49152) == 512  # a 2-row micro-batch: one chunk
    assert auto_chunk_size(8, 2048, 49152) == 128
    assert auto_chunk_size(2, 100, 49152) == 100  # never longer than the sequence
    assert auto_chunk_size(64, 4096, 152064) == 16  # floor of 16 positions
    for b, v in ((1, 32000), (3, 49152), (8, 262144)):
        c = auto_chunk_size(b, 10_000, v)
        assert c >= 16 and c & (c - 1) == 0
        assert 4 * b * c * v <= DEFAULT_CHUNK_BYTES or c == 16
        assert 4 * b * 2 * c * v > DEFAULT_CHUNK_BYTES  # the largest power of two that fits
    # None (the default) is the automatic size: same values as an explicit chunk.
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (30, 8))
    y = jax.random.randint(jax.random.PRNGKey(2), (2, 40), 0, 30)
    np.testing.assert_allclose(token_logprobs(h, w, y), token_logprobs(h, w, y, chunk_size=7),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [4, 8, 37, None])
def test_wanted_positions_equal_naive_values_and_gradients(chunk):
    """`where_bt`: the wanted positions' log-probs, entropies and gradients are the naive
    path's; the others read 0 and send no gradient."""
    h, w, y = _inputs()
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    where = jax.random.bernoulli(k1, 0.3, y.shape).at[:, :10].set(False).at[1].set(False)
    g_bt = jax.random.normal(k2, y.shape)
    lp, ent = token_logprobs(h, w, y, with_entropy=True, where_bt=where, chunk_size=chunk)
    lp_ref, ent_ref = naive_token_logprobs(h, w, y, with_entropy=True)
    np.testing.assert_allclose(lp, np.where(where, lp_ref, 0.0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, np.where(where, ent_ref, 0.0), rtol=1e-6, atol=1e-6)

    def loss(fn, h, w, **kw):
        lp, ent = fn(h, w, y, with_entropy=True, temperature=0.9, **kw)
        return jnp.sum(jnp.where(where, lp * g_bt + 0.3 * ent, 0.0))

    grads = jax.jit(jax.grad(lambda h, w: loss(token_logprobs, h, w, where_bt=where,
                                               chunk_size=chunk), (0, 1)))(h, w)
    grads_ref = jax.grad(lambda h, w: loss(naive_token_logprobs, h, w), (0, 1))(h, w)
    for got, ref in zip(grads, grads_ref):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_chunks_without_wanted_positions_are_skipped():
    """Each row wants exactly one chunk's worth of (scattered) positions; every other position
    holds NaN. Computing any chunk past the first would put NaN into the weight gradient
    (NaN logits times a zero cotangent), so finite values and gradients show the skip."""
    b, t, d, v, c = 2, 32, 8, 20, 8
    h, w, y = _inputs(b=b, t=t, d=d, v=v)
    where = np.zeros((b, t), bool)
    where[0, [1, 3, 4, 9, 15, 20, 28, 31]] = True
    where[1, 16:24] = True
    poisoned = jnp.where(jnp.asarray(where)[..., None], h, jnp.nan)
    f = jax.jit(jax.value_and_grad(
        lambda h, w: jnp.sum(token_logprobs(h, w, y, where_bt=where, chunk_size=c)), (0, 1)))
    value, (gh, gw) = f(poisoned, w)
    ref = naive_token_logprobs(h, w, y)
    np.testing.assert_allclose(value, jnp.sum(jnp.where(where, ref, 0.0)), rtol=1e-5)
    assert np.isfinite(np.asarray(gw)).all()
    assert np.isfinite(np.asarray(gh)[where]).all()
    # The same poison without the mask-aware path does reach the gradient.
    full = jax.grad(lambda w: jnp.sum(jnp.where(where, token_logprobs(poisoned, w, y,
                                                                      chunk_size=c), 0.0)))(w)
    assert not np.isfinite(np.asarray(full)).all()


def test_wanted_positions_shape_error():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="where_bt shape"):
        token_logprobs(h, w, y, where_bt=jnp.ones((3, 5), bool))
