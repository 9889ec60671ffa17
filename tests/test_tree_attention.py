"""The tree-attention Pallas kernel (Pallas interpret mode on CPU) against dense attention under
the same mask: values and gradients on random trees with padding, soft cap and sliding window, in
float32 (1e-5) and bfloat16 (no worse than dense bf16 against float32); block skipping never skips
a visible key; and a model with fused attention equals the "xla" path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from steprl_jax.models.attention import MASKED, attention, tree_mask
from steprl_jax.models.config import ModelConfig
from steprl_jax.models.transformer import Transformer
from steprl_jax.ops.tree_attention import TreeRows, block_visibility, tree_attention


def random_rows(rng, B, T):
    """Rows of preorder-numbered random trees (branch lengths random), a second packed segment
    in some rows, and padding at the end of some."""
    out = []
    for _ in range(B):
        n = int(rng.integers(2, 8))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        kids = {i: [c for c in range(1, n) if parent[c] == i] for i in range(n)}
        order, size = [], {}

        def walk(u):
            order.append(u)
            size[u] = 1 + sum(walk(c) for c in kids[u])
            return size[u]

        walk(0)
        pre = {u: i for i, u in enumerate(order)}
        node, end, pos = [], [], []
        depth_pos = {0: 0}
        for u in order:
            start = depth_pos[parent[u]] if u else 0
            length = int(rng.integers(1, T // n + 1))
            node += [pre[u]] * length
            end += [pre[u] + size[u]] * length
            pos += list(range(start, start + length))
            depth_pos[u] = start + length
        used = min(len(node), T - int(rng.integers(0, 9)))
        valid = np.arange(T) < used
        pad = lambda x: np.array((x + [0] * T)[:T])  # noqa: E731
        seg = np.where(np.arange(T) >= used // 2, 1, 0) if rng.random() < 0.5 else np.zeros(T, int)
        out.append((valid, seg, pad(node), pad(end), pad(pos)))
    return TreeRows(*(jnp.asarray(np.stack(x)) for x in zip(*out)))


def dense(q_bnth, k, v, rows, softcap, window, dtype):
    B, N, T, H = q_bnth.shape
    mask = tree_mask(jnp, rows.valid, rows.segment, rows.node, rows.end)
    if window:
        mask = mask & (rows.position[:, :, None] - rows.position[:, None, :] < window)
    out = attention(q_bnth.transpose(0, 2, 1, 3), k, v, jnp.where(mask, 0.0, MASKED), scale=1.0, softcap=softcap,
                    dtype=dtype)  # [B, K, T, G, H]
    return out.transpose(0, 1, 3, 2, 4).reshape(B, N, T, H)


def case(seed, dtype, B=2, N=4, K=2, T=128, H=32):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, B, T)
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, s, jnp.float32) for kk, s in zip(keys, [(B, N, T, H), (B, K, T, H), (B, K, T, H)]))
    d_out = jax.random.normal(keys[3], (B, N, T, H)) * rows.valid[:, None, :, None]  # padding: no gradient
    return rows, q.astype(dtype), k.astype(dtype), v.astype(dtype), d_out


def values_and_grads(fn, q, k, v, d_out, valid):
    out, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(d_out.astype(out.dtype))
    return [out.astype(jnp.float32) * valid[:, None, :, None], *(g.astype(jnp.float32) for g in grads)]


def kernel(rows, softcap, window):
    return lambda q, k, v: tree_attention(q, k, v, rows, softcap=softcap, window=window, block_q=32, block_k=32,
                                          interpret=True)


@pytest.mark.parametrize("seed,softcap,window", [(0, None, None), (1, 30.0, None), (2, None, 16)])
def test_float32_values_and_gradients_equal_dense_attention(seed, softcap, window):
    rows, q, k, v, d_out = case(seed, jnp.float32)
    want = values_and_grads(lambda *a: dense(*a, rows, softcap, window, jnp.float32), q, k, v, d_out, rows.valid)
    got = values_and_grads(kernel(rows, softcap, window), q, k, v, d_out, rows.valid)
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        scale = float(jnp.max(jnp.abs(w)))
        assert float(jnp.max(jnp.abs(w - g))) <= 1e-5 * max(scale, 1.0), name


def test_bfloat16_is_as_close_to_float32_as_dense_bfloat16():
    rows, q, k, v, d_out = case(3, jnp.float32)
    truth = values_and_grads(lambda *a: dense(*a, rows, None, None, jnp.float32), q, k, v, d_out, rows.valid)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    dense_bf = values_and_grads(lambda *a: dense(*a, rows, None, None, jnp.bfloat16), *bf, d_out, rows.valid)
    kernel_bf = values_and_grads(kernel(rows, None, None), *bf, d_out, rows.valid)
    for name, t, d, kb in zip(("out", "dq", "dk", "dv"), truth, dense_bf, kernel_bf):
        err_dense, err_kernel = float(jnp.max(jnp.abs(d - t))), float(jnp.max(jnp.abs(kb - t)))
        assert err_kernel <= 2 * err_dense + 1e-3 * float(jnp.max(jnp.abs(t))), (name, err_kernel, err_dense)


def test_skipped_blocks_hold_no_visible_key():
    for seed in range(5):
        rows = random_rows(np.random.default_rng(seed), 3, 128)
        for window in (None, 8):
            mask = np.array(tree_mask(jnp, rows.valid, rows.segment, rows.node, rows.end))
            mask &= np.asarray(rows.valid)[:, :, None]  # what padding queries see does not matter
            if window:
                mask &= np.asarray(rows.position[:, :, None] - rows.position[:, None, :] < window)
            exact = mask.reshape(3, 4, 32, 4, 32).any(axis=(2, 4))
            conservative = np.asarray(block_visibility(rows, 32, 32, window))
            assert not (exact & ~conservative).any()
            assert conservative.sum() < exact.shape[0] * 10  # and it skips more than the causal half


def test_a_query_with_nothing_visible_gets_zero_and_no_nan():
    rows, q, k, v, d_out = case(5, jnp.float32)
    rows = rows._replace(valid=rows.valid.at[0].set(False))  # a whole padding row
    out, vjp = jax.vjp(kernel(rows, None, None), q, k, v)
    assert float(jnp.max(jnp.abs(out[0]))) == 0.0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in vjp(jnp.ones_like(out)))


@pytest.mark.parametrize("T", [384])
def test_a_model_with_fused_attention_equals_the_xla_path(T):
    """Tree rows (the tree kernel) and plain rows (splash attention), sliding window and soft cap
    included (Gemma 2), several tiles of a length the preferred tiles do not divide (384: 128-token
    tiles; padding to 128 inside is the fused prefill test's case)."""
    cfg = ModelConfig.tiny("gemma2")
    ref, fused = (Transformer(cfg.replace(attention=a), rngs=nnx.Rngs(0)) for a in ("xla", "tpu_interpret"))
    B, a, b = 2, T * 5 // 12, T * 9 // 12  # three branches: the prefix, 1, and 2 (1's sibling)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)))
    node = np.zeros((B, T), int)
    node[:, a:b], node[:, b:] = 1, 2
    end = np.where(node == 0, 3, node + 1)
    valid = np.ones((B, T), bool)
    valid[1, T - 11:] = False
    pos = np.concatenate([np.arange(a), a + np.arange(b - a), a + np.arange(T - b)])[None].repeat(B, 0)
    tree = dict(attention_mask_bt=valid, positions_bt=pos, branch_ids_bt=node, branch_ends_bt=end)
    for kw, kernel_name in ((tree, "tree_attention_fwd"), (dict(attention_mask_bt=valid), "splash")):
        jaxpr = str(jax.make_jaxpr(lambda i: fused.hidden_states(i, **kw))(ids))
        assert "pallas_call" in jaxpr and kernel_name in jaxpr  # the kernel ran, not a fallback
        loss = lambda m: jnp.sum(m.hidden_states(ids, **kw) * valid[..., None] * 0.01)  # noqa: E731
        (l1, g1), (l2, g2) = (nnx.value_and_grad(loss)(m) for m in (ref, fused))
        h1, h2 = ref.hidden_states(ids, **kw), fused.hidden_states(ids, **kw)
        assert float(jnp.max(jnp.abs(h1 - h2) * valid[..., None])) < 1e-4
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * max(float(jnp.max(jnp.abs(a))), 1.0)


def test_a_fused_prefill_samples_what_the_xla_path_samples():
    """The sampler's first prefill chunk (a fresh cache) through splash attention, later decode
    steps over the cache it wrote: the same tokens and log-probs as the "xla" path (Gemma 3:
    sliding window, padded rows of different lengths)."""
    from steprl_jax.sampling import Sampler, SamplingParams

    cfg = ModelConfig.tiny("gemma3")
    runs = []
    for impl in ("xla", "tpu_interpret"):
        sampler = Sampler(Transformer(cfg.replace(attention=impl), rngs=nnx.Rngs(0)), min_shared_prefix=0)
        state = sampler.prefill([list(range(1, 30)), list(range(5, 17))])
        _, gens = sampler.generate(state, jax.random.key(0), max_new_tokens=8, params=SamplingParams(greedy=True),
                                   stop_token_ids=())
        runs.append(gens)
    assert any(kind == "extend" and program.fresh for kind, program in sampler._programs)  # the fused prefill ran
    for a, b in zip(*runs):
        assert list(a.tokens) == list(b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
