"""Flash attention for packed tree rows on TPU: a Pallas kernel, forward and backward.

Packed rows (training/pack.py) hold trees of continuations: a branch sees its ancestors, not its
siblings. Key s is visible to query t iff

    s <= t,  valid_s,  seg_s == seg_t,  node_s <= node_t < end_s,  (window)  pos_t - pos_s < W

(`models.attention.tree_mask`, the formula the dense path uses). No library kernel takes that
mask, and building it as a [B, T, S] array costs what the kernel saves, so this kernel builds it
inside each block from [B, T] arrays and never holds more than one [block_q, block_k] tile of
logits (online softmax, as in flash attention).

Blocks that no query of a query block can see are skipped: `block_visibility` finds them from
per-block bounds of the same arrays (a conservative test: a skipped block is fully hidden; a
kept block may be) and lists each query block's visible key blocks first. The grid walks that
list; past its end the index maps repeat the last visible block, so the pipeline fetches
nothing and the body does not run (splash attention's `data_next` device, here from the row's
own arrays, computed in the program: nothing to precompute on the host).

Layout: q [B, N, T, H] (pre-scaled), k and v [B, K, S, H] (N = K * G: grouped-query
attention, query head n reads kv head n // G), S = T. Mosaic wants lane-dense tiles, so the
per-token arrays travel twice, as in splash attention: broadcast along 128 lanes when they are a
column of the logits tile, along 8 sublanes when they are a row.

Backward: dS = P * (dP - rowsum(dO * O)) (flash attention's), with Gemma's soft cap
(dlogits *= 1 - tanh^2). Two kernels: dq walks a query block's key blocks, dk/dv walk a key
block's query blocks (the transposed table), summing over the G query heads of a kv head.

A query that sees no key at all (padding) gets output 0 and no gradient: callers mask it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
MASKED = -1e30
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_FAR = 1 << 29  # beyond any node, end or position a bound compares (sums of two stay in int32)


class TreeRows(NamedTuple):
    """The [B, T] arrays the mask is made of (`tree_mask`'s arguments, plus positions)."""

    valid: jax.Array  # bool: a real token
    segment: jax.Array  # int32: packed sequence
    node: jax.Array  # int32: branch, in preorder (0 everywhere: no tree)
    end: jax.Array  # int32: one past the last branch of node's subtree (INT32_MAX: no tree)
    position: jax.Array  # int32: for the sliding window


def _fields(rows: TreeRows):
    """Per-token fields, invalid tokens given segments no other token has (-2 as a query,
    -1 as a key), so validity needs no field of its own."""
    seg = rows.segment.astype(jnp.int32)
    q = jnp.stack([rows.node, jnp.where(rows.valid, seg, -2), rows.position], -1).astype(jnp.int32)
    k = jnp.stack([rows.node, rows.end, jnp.where(rows.valid, seg, -1), rows.position], -1).astype(jnp.int32)
    return q, k  # [B, T, 3], [B, T, 4]


def block_visibility(rows: TreeRows, block_q: int, block_k: int, window: Optional[int] = None):
    """[B, Q, J] bool: key block j may hold a key that a query of query block i sees.
    Conservative, from each block's bounds (node, end, segment and position ranges of its real
    tokens): False only for a block that is fully hidden."""
    B, T = rows.valid.shape

    def bounds(x, block, lo):
        x = jnp.where(rows.valid, x, _FAR if lo else -_FAR).reshape(B, -1, block)
        return x.min(-1) if lo else x.max(-1)

    lo, hi = (lambda x, b: bounds(x, b, True)), (lambda x, b: bounds(x, b, False))
    qa = lambda x: x[:, :, None]  # noqa: E731
    ka = lambda x: x[:, None, :]  # noqa: E731
    i, j = jnp.arange(T // block_q)[:, None], jnp.arange(T // block_k)[None, :]
    end = jnp.minimum(rows.end, _FAR)
    visible = ((j * block_k <= i * block_q + block_q - 1)[None]
               & (ka(lo(rows.segment, block_k)) <= qa(hi(rows.segment, block_q)))
               & (qa(lo(rows.segment, block_q)) <= ka(hi(rows.segment, block_k)))
               & (ka(lo(rows.node, block_k)) <= qa(hi(rows.node, block_q)))
               & (qa(lo(rows.node, block_q)) < ka(hi(end, block_k))))
    if window is not None:
        visible &= qa(lo(rows.position, block_q)) - ka(hi(rows.position, block_k)) < window
    return visible


def _compact(visible):
    """[B, Q, J] bool -> (table [B, Q, J] int32, count [B, Q]): row (b, i)'s visible j
    ascending in table[b, i, :count], the rest repeating the last of them (the pipeline then
    fetches nothing new)."""
    count = visible.sum(-1).astype(jnp.int32)
    order = jnp.argsort(~visible, axis=-1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], -1)
    m = jnp.arange(visible.shape[-1])
    return jnp.where(m < count[..., None], order, last), count


def _visible(t_idx, s_idx, q, k, window):
    """The mask of one tile from the fields of its queries and keys (broadcasting shapes)."""
    node_t, seg_t, pos_t = q
    node_s, end_s, seg_s, pos_s = k
    ok = (s_idx <= t_idx) & (seg_s == seg_t) & (node_s <= node_t) & (node_t < end_s)
    if window is not None:
        ok &= pos_t - pos_s < window
    return ok


def _dot(a, b, dims):
    """float32-accumulated product; bf16 operands at the MXU's native precision (an explicit
    precision: a global "highest" default is refused by Mosaic for bf16), float32 ones exact."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=(precision, precision), preferred_element_type=jnp.float32)


def _logits(s, softcap):
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


# --------------------------------------------------------------------------- forward
def _fwd_kernel(table_ref, count_ref, q_ref, k_ref, v_ref, qf_ref, kf_ref, o_ref, lse_ref,
                m_sc, l_sc, acc_sc, *, block_q, block_k, softcap, window, num_q, num_k):
    b, i, m = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    j = table_ref[(b * num_q + i) * num_k + m]

    @pl.when(m == 0)
    def _init():
        m_sc[...] = jnp.full_like(m_sc, MASKED)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(m < count_ref[b * num_q + i])
    def _run():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = _logits(_dot(q, k, _NT), softcap)
        qf, kf = qf_ref[...], kf_ref[...]  # [bq, 128], [8, bk]
        t_idx = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        s_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        ok = _visible(t_idx, s_idx, [qf[:, c:c + 1] for c in range(3)], [kf[c:c + 1, :] for c in range(4)],
                      window)
        s = jnp.where(ok, s, MASKED)
        m_prev = m_sc[...]  # [bq, 128], every lane the same
        m_next = jnp.maximum(m_prev, s.max(-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(ok, jnp.exp(s - m_next[:, :1]), 0.0)
        l_sc[...] = alpha * l_sc[...] + p.sum(-1, keepdims=True)
        m_sc[...] = m_next
        acc_sc[...] = alpha[:, :1] * acc_sc[...] + _dot(
            p.astype(v.dtype), v, _NN)

    @pl.when(m == num_k - 1)
    def _end():
        l = l_sc[...]
        seen = l > 0  # a query with no visible key: output 0, log-sum-exp 0 (its p stays 0)
        o_ref[...] = (acc_sc[...] / jnp.where(seen, l, 1.0)[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _specs_common(block_q, block_k, G, H, num_q, num_k, transposed=False):
    """Index maps. Forward/dq grid: (b, n, i, m), key block table[b, i, m]. dkv grid:
    (b, kv, j, g, m), query block table_t[b, j, m], query head kv * G + g."""
    if not transposed:
        key = lambda b, i, m, t: t[(b * num_q + i) * num_k + m]  # noqa: E731
        q_map = lambda b, n, i, m, t, c: (b, n, i, 0)  # noqa: E731
        kv_map = lambda b, n, i, m, t, c: (b, n // G, key(b, i, m, t), 0)  # noqa: E731
        return q_map, kv_map, key
    query = lambda b, j, m, t: t[(b * num_k + j) * num_q + m]  # noqa: E731
    q_map = lambda b, kv, j, g, m, t, c: (b, kv * G + g, query(b, j, m, t), 0)  # noqa: E731
    kv_map = lambda b, kv, j, g, m, t, c: (b, kv, j, 0)  # noqa: E731
    return q_map, kv_map, query


def _cost(q, k, matmuls: int) -> pl.CostEstimate:
    """What a kernel declares to XLA's cost analysis (which cannot see inside it): `matmuls`
    [T, T/2] x H products per query head (the causal half; hidden tiles skipped make it less),
    an exponential per logit, q, k, v and the output read or written once."""
    B, N, T, H = q.shape
    logits = B * N * T * T // 2
    return pl.CostEstimate(flops=2 * matmuls * logits * H, transcendentals=logits,
                           bytes_accessed=2 * (q.size + 2 * k.size) * q.dtype.itemsize)


def _forward(q, k, v, qf_lanes, kf_sub, table, count, *, softcap, window, block_q, block_k, interpret):
    B, N, T, H = q.shape
    K = k.shape[1]
    G, num_q, num_k = N // K, T // block_q, T // block_k
    q_map, kv_map, key = _specs_common(block_q, block_k, G, H, num_q, num_k)
    kernel = functools.partial(_fwd_kernel, block_q=block_q, block_k=block_k, softcap=softcap, window=window,
                               num_q=num_q, num_k=num_k)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, N, num_q, num_k),
        in_specs=[pl.BlockSpec((None, None, block_q, H), q_map),
                  pl.BlockSpec((None, None, block_k, H), kv_map),
                  pl.BlockSpec((None, None, block_k, H), kv_map),
                  pl.BlockSpec((None, block_q, LANES), lambda b, n, i, m, t, c: (b, i, 0)),
                  pl.BlockSpec((None, SUBLANES, block_k), lambda b, n, i, m, t, c: (b, 0, key(b, i, m, t)))],
        out_specs=[pl.BlockSpec((None, None, block_q, H), q_map),
                   pl.BlockSpec((None, None, block_q, LANES), q_map)],
        scratch_shapes=[pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
                        pltpu.VMEM((block_q, H), jnp.float32)])
    o, lse = pl.pallas_call(
        kernel, grid_spec=grid,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="tree_attention_fwd", cost_estimate=_cost(q, k, 2),
    )(table.reshape(-1), count.reshape(-1), q, k, v, qf_lanes, kf_sub)
    return o, lse[..., 0]


# --------------------------------------------------------------------------- backward
def _tile_grads(a, b, d_a, d_b, ok, lse, di, softcap):
    """(P, dS) of one tile, logits a @ b.T: queries x keys (a = q, d_a = dO, d_b = V) or, for
    dk/dv, keys x queries (a = k, d_a = V, d_b = dO). dS = P * (dO V^T - rowsum(dO * O)), and
    through the soft cap dS *= 1 - tanh^2."""
    raw = _dot(a, b, _NT)
    p = jnp.where(ok, jnp.exp(_logits(raw, softcap) - lse), 0.0)
    ds = p * (_dot(d_a, d_b, _NT) - di)
    if softcap is not None:
        th = jnp.tanh(raw / softcap)
        ds = ds * (1 - th * th)
    return p, ds


def _dq_kernel(table_ref, count_ref, q_ref, k_ref, v_ref, qf_ref, kf_ref, lse_ref, do_ref, di_ref, dq_ref, acc_sc,
               *, block_q, block_k, softcap, window, num_q, num_k):
    b, i, m = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    j = table_ref[(b * num_q + i) * num_k + m]

    @pl.when(m == 0)
    def _init():
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(m < count_ref[b * num_q + i])
    def _run():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        qf, kf = qf_ref[...], kf_ref[...]
        t_idx = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        s_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        ok = _visible(t_idx, s_idx, [qf[:, c:c + 1] for c in range(3)], [kf[c:c + 1, :] for c in range(4)],
                      window)
        lse = jnp.expand_dims(lse_ref[0], -1)  # [bq, 1]
        di = jnp.expand_dims(di_ref[0], -1)
        _, ds = _tile_grads(q, k, do, v, ok, lse, di, softcap)
        acc_sc[...] += _dot(ds.astype(k.dtype), k, _NN)

    @pl.when(m == num_k - 1)
    def _end():
        dq_ref[...] = acc_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(table_ref, count_ref, q_ref, k_ref, v_ref, qf_ref, kf_ref, lse_ref, do_ref, di_ref,
                dk_ref, dv_ref, dk_sc, dv_sc, *, block_q, block_k, softcap, window, num_q, num_k, G):
    b, j, g, m = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    i = table_ref[(b * num_k + j) * num_q + m]

    @pl.when((g == 0) & (m == 0))
    def _init():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    @pl.when(m < count_ref[b * num_k + j])
    def _run():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        # Transposed tile [bk, bq]: the query-side rows (log-sum-exp, di, fields) broadcast
        # along sublanes, the key-side ones along lanes.
        qf, kf = qf_ref[...], kf_ref[...]  # [8, bq], [bk, 128]
        s_idx = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        t_idx = i * block_q + lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
        ok = _visible(t_idx, s_idx, [qf[c:c + 1, :] for c in range(3)], [kf[:, c:c + 1] for c in range(4)],
                      window)
        p, ds = _tile_grads(k, q, v, do, ok, lse_ref[:1, :], di_ref[:1, :], softcap)  # [bk, bq]
        dv_sc[...] += _dot(p.astype(do.dtype), do, _NN)
        dk_sc[...] += _dot(ds.astype(q.dtype), q, _NN)

    @pl.when((g == G - 1) & (m == num_q - 1))
    def _end():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _backward(q, k, v, o, lse, do, fields, tables, *, softcap, window, block_q, block_k, interpret):
    (qf_lanes, qf_sub, kf_lanes, kf_sub), (table, count, table_t, count_t) = fields, tables
    B, N, T, H = q.shape
    K = k.shape[1]
    G, num_q, num_k = N // K, T // block_q, T // block_k
    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1)  # [B, N, T]
    lse8, di8 = (jnp.broadcast_to(x[:, :, None, :], (B, N, SUBLANES, T)) for x in (lse, di))
    common = dict(block_q=block_q, block_k=block_k, softcap=softcap, window=window, num_q=num_q, num_k=num_k)

    q_map, kv_map, key = _specs_common(block_q, block_k, G, H, num_q, num_k)
    row_map = lambda b, n, i, m, t, c: (b, n, 0, i)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, N, num_q, num_k),
            in_specs=[pl.BlockSpec((None, None, block_q, H), q_map),
                      pl.BlockSpec((None, None, block_k, H), kv_map),
                      pl.BlockSpec((None, None, block_k, H), kv_map),
                      pl.BlockSpec((None, block_q, LANES), lambda b, n, i, m, t, c: (b, i, 0)),
                      pl.BlockSpec((None, SUBLANES, block_k), lambda b, n, i, m, t, c: (b, 0, key(b, i, m, t))),
                      pl.BlockSpec((None, None, SUBLANES, block_q), row_map),
                      pl.BlockSpec((None, None, block_q, H), q_map),
                      pl.BlockSpec((None, None, SUBLANES, block_q), row_map)],
            out_specs=pl.BlockSpec((None, None, block_q, H), q_map),
            scratch_shapes=[pltpu.VMEM((block_q, H), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="tree_attention_dq", cost_estimate=_cost(q, k, 3),
    )(table.reshape(-1), count.reshape(-1), q, k, v, qf_lanes, kf_sub, lse8, do, di8)

    q_map_t, kv_map_t, query = _specs_common(block_q, block_k, G, H, num_q, num_k, transposed=True)
    row_map_t = lambda b, kv, j, g, m, t, c: (b, kv * G + g, 0, query(b, j, m, t))  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, G=G, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K, num_k, G, num_q),
            in_specs=[pl.BlockSpec((None, None, block_q, H), q_map_t),
                      pl.BlockSpec((None, None, block_k, H), kv_map_t),
                      pl.BlockSpec((None, None, block_k, H), kv_map_t),
                      pl.BlockSpec((None, SUBLANES, block_q),
                                   lambda b, kv, j, g, m, t, c: (b, 0, query(b, j, m, t))),
                      pl.BlockSpec((None, block_k, LANES), lambda b, kv, j, g, m, t, c: (b, j, 0)),
                      pl.BlockSpec((None, None, SUBLANES, block_q), row_map_t),
                      pl.BlockSpec((None, None, block_q, H), q_map_t),
                      pl.BlockSpec((None, None, SUBLANES, block_q), row_map_t)],
            out_specs=[pl.BlockSpec((None, None, block_k, H), kv_map_t),
                       pl.BlockSpec((None, None, block_k, H), kv_map_t)],
            scratch_shapes=[pltpu.VMEM((block_k, H), jnp.float32), pltpu.VMEM((block_k, H), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret, name="tree_attention_dkv", cost_estimate=_cost(q, k, 4),
    )(table_t.reshape(-1), count_t.reshape(-1), q, k, v, qf_sub, kf_lanes, lse8, do, di8)
    return dq, dk, dv


# --------------------------------------------------------------------------- the op
def _layouts(rows: TreeRows):
    q, k = _fields(rows)
    B, T = rows.valid.shape
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[-1])))  # noqa: E731
    lanes = lambda x: pad(x, LANES)  # [B, T, 128]: column c = field c  # noqa: E731
    sub = lambda x: pad(x, SUBLANES).transpose(0, 2, 1)  # [B, 8, T]: row c = field c  # noqa: E731
    return lanes(q), sub(q), lanes(k), sub(k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attend(q, k, v, rows, softcap, window, block_q, block_k, interpret):
    return _attend_fwd(q, k, v, rows, softcap, window, block_q, block_k, interpret)[0]


def _tables(rows, block_q, block_k, window):
    """The forward's table (a query block's key blocks) and the transposed one (a key block's
    query blocks, for dk/dv), with their counts."""
    visible = block_visibility(rows, block_q, block_k, window)
    return (*_compact(visible), *_compact(visible.transpose(0, 2, 1)))


def _attend_fwd(q, k, v, rows, softcap, window, block_q, block_k, interpret):
    fields = _layouts(rows)
    tables = _tables(rows, block_q, block_k, window)
    o, lse = _forward(q, k, v, fields[0], fields[3], tables[0], tables[1], softcap=softcap, window=window,
                      block_q=block_q, block_k=block_k, interpret=interpret)
    return o, (q, k, v, o, lse, rows)


def _attend_bwd(softcap, window, block_q, block_k, interpret, res, do):
    # The field layouts and block tables are rebuilt from `rows` rather than kept from the
    # forward: a few [B, T]-sized passes, against [B, T, 128] residuals per layer.
    q, k, v, o, lse, rows = res
    dq, dk, dv = _backward(q, k, v, o, lse, do, _layouts(rows), _tables(rows, block_q, block_k, window),
                           softcap=softcap, window=window, block_q=block_q, block_k=block_k, interpret=interpret)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jax.dtypes.float0), rows)
    return dq, dk, dv, zeros


_attend.defvjp(_attend_fwd, _attend_bwd)


def tree_attention(q_bnth, k_bksh, v_bksh, rows: TreeRows, *, softcap: Optional[float] = None,
                   window: Optional[int] = None, block_q: int = 256, block_k: int = 256,
                   interpret: bool = False):
    """Attention of pre-scaled queries [B, N, T, H] over keys and values [B, K, T, H] under the
    tree mask of `rows`; returns [B, N, T, H] in q's dtype (float32 accumulation). T must be a
    multiple of both blocks (the packer's lengths are); `interpret` runs the kernel on CPU."""
    T = q_bnth.shape[2]
    block_q, block_k = min(block_q, T), min(block_k, T)
    if T % block_q or T % block_k:
        raise ValueError(f"tree_attention: length {T} is not a multiple of the blocks ({block_q}, {block_k})")
    if q_bnth.shape[1] % k_bksh.shape[1]:
        raise ValueError(f"tree_attention: {q_bnth.shape[1]} query heads over {k_bksh.shape[1]} kv heads")
    rows = TreeRows(*(jnp.asarray(x, bool if f == "valid" else jnp.int32) for f, x in zip(TreeRows._fields, rows)))
    return _attend(q_bnth, k_bksh, v_bksh, rows, softcap, window, block_q, block_k, interpret)
