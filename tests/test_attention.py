"""Attention's hand-written backward against JAX's own differentiation of the textbook formula."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.models.attention import MASKED, attention, attention_with_shared, causal_attention


def reference(q_btnh, k_bksh, v_bksh, bias_bts, *, scale, softcap):
    """softmax(q k^T * scale [softcapped] + bias) v, one query head at a time, float32."""
    K = k_bksh.shape[1]
    G = q_btnh.shape[2] // K
    k_bnsh = jnp.repeat(k_bksh, G, axis=1)
    v_bnsh = jnp.repeat(v_bksh, G, axis=1)
    logits = jnp.einsum("btnh,bnsh->bnts", q_btnh * scale, k_bnsh)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    probs = jax.nn.softmax(logits + bias_bts[:, None], axis=-1)
    out = jnp.einsum("bnts,bnsh->btnh", probs, v_bnsh)
    B, T, N, H = out.shape
    return out.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H] as `attention`


def tree_bias(rng, B, T):
    """A causal mask with random segments (sibling branches hide each other) and padding."""
    idx = np.arange(T)
    seg = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    valid = np.ones((B, T), bool)
    valid[0, -5:] = False  # padding: fully masked query rows
    mask = (idx[None, :, None] >= idx[None, None, :]) & valid[:, None, :] & (
        (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0))
    return jnp.asarray(np.where(mask, 0.0, MASKED), jnp.float32), valid


def inputs(rng, B, T, N, K, H):
    return (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32),
            jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32),
            jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32))


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("fn", [attention, causal_attention])
def test_gradients_equal_autodiff_of_the_textbook_formula(fn, softcap):
    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 300, 6, 2, 16  # 300 > one causal block: blocks of 128, 128 and 44
    q, k, v = inputs(rng, B, T, N, K, H)
    bias, valid = tree_bias(rng, B, T)
    cot = jnp.asarray(rng.normal(size=(B, K, T, N // K, H)), jnp.float32)
    cot = cot * jnp.asarray(valid)[:, None, :, None, None]  # padding queries carry no loss
    kw = dict(scale=0.25, softcap=softcap)

    def loss(f, **extra):
        return lambda q, k, v: jnp.sum(f(q, k, v, bias, **kw, **extra) * cot)

    ours, ours_grads = jax.value_and_grad(loss(fn, dtype=jnp.float32), argnums=(0, 1, 2))(q, k, v)
    ref, ref_grads = jax.value_and_grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    for name, a, b in zip("qkv", ours_grads, ref_grads):
        scale = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, f"d{name}"


def test_bf16_operands_stay_close_to_float32():
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, 1, 256, 4, 2, 32)
    bias, _ = tree_bias(rng, 1, 256)
    grads = {dt: jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, bias, scale=0.2, softcap=None,
                                                                  dtype=dt) ** 2), argnums=(0, 1, 2))(q, k, v)
             for dt in (jnp.float32, jnp.bfloat16)}
    for a, b in zip(grads[jnp.bfloat16], grads[jnp.float32]):
        assert a.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(a - b))) <= 0.05 * float(jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("boolean", [False, True])
def test_attention_with_a_shared_segment_equals_attention_over_the_keys_joined(softcap, boolean):
    """Each row's own keys, then P keys held once for all rows: the same as every row holding
    its own copy of them, under one mask (rows that do not continue the segment mask it out)."""
    rng = np.random.default_rng(5)
    B, T, N, K, H, S, P = 3, 2, 4, 2, 8, 6, 5
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
    shared_k, shared_v = (jnp.asarray(rng.normal(size=(K, P, H)), jnp.float32) for _ in range(2))
    visible = rng.random((B, T, S + P)) < 0.7
    visible[1, :, S:] = False  # row 1 is not on the segment
    mask = jnp.asarray(visible) if boolean else jnp.asarray(np.where(visible, 0.0, MASKED), jnp.float32)
    out = attention_with_shared(q, k, v, shared_k, shared_v, mask, scale=0.3, softcap=softcap, dtype=jnp.float32)
    joined = lambda own, seg: jnp.concatenate([own, jnp.broadcast_to(seg, (B, K, P, H))], axis=2)  # noqa: E731
    bias = jnp.asarray(np.where(visible, 0.0, MASKED), jnp.float32)
    want = reference(q, joined(k, shared_k), joined(v, shared_v), bias, scale=0.3, softcap=softcap)
    np.testing.assert_allclose(out, want, atol=1e-5)
