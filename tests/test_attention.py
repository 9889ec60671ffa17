"""The attention kernel's custom backward equals automatic differentiation of the same forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.models.transformer import _MASKED, _attention_core


def reference_attention(q_bkmh, k_bksh, v_bksh, bias_bts, cap, groups):
    B, K, M, _ = q_bkmh.shape
    logits = jnp.einsum("bkmh,bksh->bkms", q_bkmh, k_bksh)
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    logits = logits.reshape(B, K, M // groups, groups, -1) + bias_bts[:, None, :, None, :]
    probs = jax.nn.softmax(logits, axis=-1).reshape(B, K, M, -1)
    return jnp.einsum("bkms,bksh->bkmh", probs, v_bksh)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_custom_attention_gradients_equal_autodiff(cap):
    B, K, G, T, S, H = 2, 2, 3, 5, 7, 8
    rng = np.random.default_rng(0)
    q, dout = (jnp.asarray(rng.normal(size=(B, K, T * G, H)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, H)), jnp.float32) for _ in range(2))
    visible = np.tril(np.ones((T, S), bool), k=S - T)[None].repeat(B, 0)
    visible[1, :, :2] = False  # left padding
    visible[1, 0] = False  # a fully masked (padding) query row
    bias = jnp.asarray(np.where(visible, 0.0, _MASKED), jnp.float32)

    def ours(q, k, v):
        return jnp.sum(_attention_core(jnp.dtype(jnp.float32), cap, G, q, k, v, bias) * dout)

    def ref(q, k, v):
        return jnp.sum(reference_attention(q, k, v, bias, cap, G) * dout)

    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-5)
    for g, g_ref in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
        assert float(jnp.abs(g_ref).max()) > 0
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_bf16_attention_gradients_are_close_to_float32():
    B, K, G, T, H = 1, 1, 2, 16, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, K, T * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(np.where(np.tril(np.ones((T, T), bool)), 0.0, _MASKED), jnp.float32)[None]
    grads = {dt: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(_attention_core(jnp.dtype(dt), None, G, q, k, v, bias))),
                          (0, 1, 2))(q, k, v) for dt in (jnp.float32, jnp.bfloat16)}
    for g16, g32 in zip(grads[jnp.bfloat16], grads[jnp.float32]):
        assert g16.dtype == jnp.float32
        np.testing.assert_allclose(g16, g32, atol=0.05 * float(jnp.abs(g32).max()))
