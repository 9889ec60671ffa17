"""Grouped-query attention over an additive mask bias, with its own backward pass.

`attention` takes queries [B, T, N, H], keys and values laid out [B, K, S, H] (the KV cache's
layout) and a float32 bias [B, T, S] (0 for a visible key, MASKED for a hidden one) or a
boolean mask [B, T, S] (True: visible); it returns
[B, K, T, G, H] (query head n = k * G + g). `causal_attention` is the same over a full sequence
whose mask is causal, computed per block of queries over the keys up to the block's end.

Packed tree rows (training/pack.py) hide most of the keys before a query: a branch sees its
ancestors, not its siblings. For them the packer also gives `key_blocks` [B, Q, M] (host-side,
`key_block_table`): for each block of queries, the M blocks of KEY_BLOCK keys that hold every
key one of its queries sees. The queries of a block then attend over those M blocks, gathered,
instead of every key before them: exact, and on the PORTool benchmark's trees (2,048 tokens)
~40% fewer logits (166k against 279k per sample).

The core (logits -> softmax -> values) has a hand-written VJP, the one flash attention uses:
with P the probabilities and O the output, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K,
dK = dS^T Q, dV = P^T dO. Left to JAX's differentiation rules, XLA:CPU spent ~3x the time of
this backward on the softmax's (measured on a 128-query block of a 2,048-token row of
SmolLM2: 39 ms against 12 ms forward + backward, bf16 operands); the gradients agree to
float32 rounding (tests/test_attention.py).

Shapes: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim;
in the core, M = T * G (a kv head's queries, merged); in `key_blocks` [B, Q, M], Q query blocks
and M gathered key blocks each.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from steprl_jax.ops.matmul import einsum_f32
from steprl_jax.shapes import bucket

MASKED = -1e30  # finite, so a fully masked (padding) query row gives no NaN

# Query block of the full-sequence (causal) attention: block i attends only to keys before its
# end, so about half of the logits are never computed (5/8 of them at T = 4 blocks). Long
# sequences use longer blocks, at most MAX_CAUSAL_BLOCKS of them, to bound the program size.
CAUSAL_QUERY_BLOCK = 128
MAX_CAUSAL_BLOCKS = 16
# Keys are gathered in blocks of this many (`key_blocks`): finer than the query block, so a block
# of queries from several branches gathers little that it does not see.
KEY_BLOCK = 32


def query_block(length: int) -> int:
    """The query block of `causal_attention` over a sequence of `length` tokens."""
    return max(CAUSAL_QUERY_BLOCK, -(-length // MAX_CAUSAL_BLOCKS))


def tree_mask(xp, valid_bt, segments_bt=None, node_bt=None, end_bt=None):
    """[B, T, T] boolean: query t sees key s. Causal, over real keys of its own segment and,
    in a packed tree, of its own branch and its ancestors (key s is visible to query t iff
    node_s <= node_t < end_s: branches in preorder, `end` one past a branch's subtree). `xp` is
    numpy (the packer's key_block_table) or jax.numpy (the model): one formula for both."""
    T = valid_bt.shape[1]
    idx = xp.arange(T)
    mask = (idx[None, :, None] >= idx[None, None, :]) & xp.asarray(valid_bt, bool)[:, None, :]
    if segments_bt is not None:
        mask = mask & (segments_bt[:, :, None] == segments_bt[:, None, :])
    if node_bt is not None:
        mask = mask & (node_bt[:, None, :] <= node_bt[:, :, None]) & (node_bt[:, :, None] < end_bt[:, None, :])
    return mask


def key_block_count(needed: int) -> int:
    """The M a table whose query blocks need at most `needed` key blocks is given: the next of 4,
    6, 8, 12, 16, 24, 32, ... (`shapes.bucket`, two per doubling). Each M is one more compiled
    train step, and the trees of an online run need a different count almost every iteration:
    rounding up to a multiple of 4 compiled the step again in most iterations (a 7B step takes
    minutes to compile); this gathers at most 1.5x the blocks needed and compiles a few times a
    run. On the packed-training benchmark's trees (15 sizes and seeds) it computes 0-27% more
    attention logits than multiples of 4 (14% on average), and one count where those gave 36-40."""
    return bucket(needed, 4)


def key_block_table(valid_bt: np.ndarray, node_bt: np.ndarray, end_bt: np.ndarray) -> Optional[np.ndarray]:
    """`key_blocks` [B, Q, M] of packed tree rows (host-side; `tree_mask`'s arguments): the
    queries of row b's query block i see keys in the KEY_BLOCK-token blocks key_blocks[b, i, :c]
    only (ascending), followed by blocks they see nothing of. M is the largest c, rounded up by
    `key_block_count` (few distinct shapes to compile). None when that saves nothing over
    `causal_attention`'s plain blocks."""
    B, T = valid_bt.shape
    block = query_block(T)
    if T % block or T == block or block % KEY_BLOCK:
        return None
    Q, S = T // block, T // KEY_BLOCK
    seen = np.stack([  # [B, Q, S]: one row at a time, a [T, T] mask each
        tree_mask(np, valid_bt[b:b + 1], None, node_bt[b:b + 1], end_bt[b:b + 1]).reshape(Q, block, S, KEY_BLOCK)
        .any(axis=(1, 3)) for b in range(B)])
    # Visible blocks (key False) first, then the hidden ones in order. The mask is causal, so
    # query block i's first (i + 1) * block / KEY_BLOCK entries are the blocks before its end.
    order = np.argsort(~seen, axis=-1, kind="stable")
    M = key_block_count(int(seen.sum(-1).max()))
    if M * KEY_BLOCK >= T - block:  # gathers only where fewer than the plain blocks: none here
        return None
    return np.ascontiguousarray(order[:, :, :M]).astype(np.int32)


def causal_attention(q_btnh, k_bksh, v_bksh, bias_bts, *, scale: float, softcap: Optional[float], dtype,
                     key_blocks=None):
    """`attention` over a full sequence (key s = position s) whose mask is causal, computed
    per block of queries over the keys up to the block's last position only, or with
    `key_blocks` (`key_block_table`) over the blocks it names where they are fewer. Exact for
    every query with a visible key (the keys left out are masked for the whole block); a fully
    masked padding query averages the values it is given, as `attention` does."""
    B, T = q_btnh.shape[:2]
    block = query_block(T)
    run = functools.partial(attention, scale=scale, softcap=softcap, dtype=dtype)
    if T <= block:
        return run(q_btnh, k_bksh, v_bksh, bias_bts)
    if key_blocks is not None:
        M = key_blocks.shape[2]
        blocks = lambda x: x.reshape(*x.shape[:2], T // KEY_BLOCK, KEY_BLOCK, x.shape[-1])  # noqa: E731
        k_blocks, v_blocks = blocks(k_bksh), blocks(v_bksh)  # [B, K, S, KEY_BLOCK, H]
    outs = []
    for i, start in enumerate(range(0, T, block)):
        end = min(start + block, T)
        q = q_btnh[:, start:end]
        if key_blocks is None or M * KEY_BLOCK >= end:
            outs.append(run(q, k_bksh[:, :, :end], v_bksh[:, :, :end], bias_bts[:, start:end, :end]))
            continue
        idx = key_blocks[:, i, :]  # [B, M]
        gather = lambda x: jnp.take_along_axis(x, idx[:, None, :, None, None], axis=2).reshape(  # noqa: E731
            B, x.shape[1], M * KEY_BLOCK, x.shape[-1])
        bias = jnp.take_along_axis(bias_bts[:, start:end].reshape(B, end - start, T // KEY_BLOCK, KEY_BLOCK),
                                   idx[:, None, :, None], axis=2).reshape(B, end - start, M * KEY_BLOCK)
        outs.append(run(q, gather(k_blocks), gather(v_blocks), bias))
    return jnp.concatenate(outs, axis=2)


def attention(q_btnh, k_bksh, v_bksh, bias_bts, *, scale: float, softcap: Optional[float], dtype):
    """Attention of T queries over S keys; `dtype` is the matmuls' operand dtype (float32
    accumulation). Queries are laid out [B, K, T*G, H] (a kv head's G query heads and the T
    positions merged), so each product is a plain batched matmul over (B, K): on XLA:CPU
    2-3x faster than a 5-d einsum with separate T and G axes."""
    B, T, N, H = q_btnh.shape
    K = k_bksh.shape[1]
    G = N // K
    q_bkmh = (q_btnh * scale).reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    out = _core(q_bkmh, k_bksh, v_bksh, bias_bts, softcap, jnp.dtype(dtype))
    return out.reshape(B, K, T, G, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _core(q_bkmh, k_bksh, v_bksh, bias_bts, softcap, dtype):
    return _core_fwd(q_bkmh, k_bksh, v_bksh, bias_bts, softcap, dtype)[0]


def _core_fwd(q_bkmh, k_bksh, v_bksh, bias_bts, softcap, dtype):
    logits = einsum_f32("bkmh,bksh->bkms", q_bkmh, k_bksh, dtype)
    probs, tanh = _masked_softmax(logits, bias_bts, softcap)
    out = einsum_f32("bkms,bksh->bkmh", probs, v_bksh, dtype)
    return out, (q_bkmh, k_bksh, v_bksh, probs, out, tanh)


def _masked_softmax(logits_bkms, bias_bts, softcap):
    """(probabilities [B, K, M, S], tanh of the softcap or None) of logits under the mask."""
    B, K, M, _ = logits_bkms.shape
    T = bias_bts.shape[1]
    tanh = None
    if softcap is not None:
        tanh = jnp.tanh(logits_bkms / softcap)
        logits_bkms = softcap * tanh
    # + MASKED is exactly MASKED in float32 (|logits| is far below its ulp), as a `where` gives.
    # A boolean mask (accelerators: no [B, T, S] float32 bias) goes through the `where`.
    logits = logits_bkms.reshape(B, K, T, M // T, -1)
    if bias_bts.dtype == jnp.bool_:
        logits = jnp.where(bias_bts[:, None, :, None, :], logits, MASKED)
    else:
        logits = logits + bias_bts[:, None, :, None, :]
    return jax.nn.softmax(logits, axis=-1).reshape(B, K, M, -1), tanh


def attention_with_shared(q_btnh, k_bksh, v_bksh, shared_k_kph, shared_v_kph, bias_bts, *, scale: float,
                          softcap: Optional[float], dtype):
    """`attention` over each row's own S keys followed by P keys every row shares (a common
    prompt prefix held once, `KVCache`'s shared segment): `bias_bts` [B, T, S + P] covers both.
    The shared keys are read once for all rows, as one [K, B*M, H] x [K, P, H] product,
    instead of once per row: a decode step of B rows reads B x S + P keys, not B x (S + P).
    Exact (one softmax over the S + P logits). No backward pass of its own: sampling only."""
    B, T, N, H = q_btnh.shape
    K = k_bksh.shape[1]
    G, S = N // K, k_bksh.shape[2]
    M = T * G
    q_bkmh = (q_btnh * scale).reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)
    q_kmh = q_bkmh.transpose(1, 0, 2, 3).reshape(K, B * M, H)  # every row's queries against the shared keys
    per_kv_head = lambda x: x.reshape(K, B, M, -1).transpose(1, 0, 2, 3)  # noqa: E731  [K, B*M, *] -> [B, K, M, *]
    logits = jnp.concatenate([einsum_f32("bkmh,bksh->bkms", q_bkmh, k_bksh, dtype),
                              per_kv_head(einsum_f32("kmh,kph->kmp", q_kmh, shared_k_kph, dtype))], axis=-1)
    probs, _ = _masked_softmax(logits, bias_bts, softcap)
    shared_probs = probs[..., S:].transpose(1, 0, 2, 3).reshape(K, B * M, -1)
    out = (einsum_f32("bkms,bksh->bkmh", probs[..., :S], v_bksh, dtype)
           + per_kv_head(einsum_f32("kmp,kph->kmh", shared_probs, shared_v_kph, dtype)))
    return out.reshape(B, K, T, G, H)


def _core_bwd(softcap, dtype, res, d_out):
    q, k, v, probs, out, tanh = res
    d_probs = einsum_f32("bkmh,bksh->bkms", d_out, v, dtype)
    # rowsum(dP * P) = rowsum(dO * O): one pass over [M, H] instead of [M, S].
    d_logits = probs * (d_probs - jnp.sum(d_out * out, axis=-1, keepdims=True))
    if tanh is not None:
        d_logits = d_logits * (1 - tanh * tanh)
    d_q = einsum_f32("bkms,bksh->bkmh", d_logits, k, dtype)
    d_k = einsum_f32("bkms,bkmh->bksh", d_logits, q, dtype)
    d_v = einsum_f32("bkms,bkmh->bksh", probs, d_out, dtype)
    # The bias is a mask: no gradient flows into it (None is a zero cotangent).
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


_core.defvjp(_core_fwd, _core_bwd)
