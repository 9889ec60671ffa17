"""Per-token log-probs (and entropies) of target tokens, chunked over the sequence.

This is THE log-prob function of the project: the sampler calls it on decode-step hidden
states ([B, 1, D]) to record the sampling log-probs, the trainer calls it on [B, T, D] to
recompute them. Using one function (same dtype policy, softmax in float32) is what keeps the
importance ratio at exactly 1 on the first update after sampling.

Definition, per position (b, t):

    z      = softcap(hidden[b, t] @ unembed.T) / temperature      # [V], float32
    logp   = z[target[b, t]] - logsumexp(z)                       # log-softmax of logits/T
    entropy = logsumexp(z) - sum_v softmax(z)_v * z_v

`softcap(x) = c * tanh(x / c)` when `final_softcap=c` (Gemma), identity otherwise; it is applied
to the raw logits before dividing by the temperature, the same order a sampler uses.

Memory: the sequence axis is cut into chunks of `chunk_size` positions; each chunk's
[B, chunk, V] float32 logits live only inside a `jax.checkpoint`ed scan body, so neither the
forward nor the backward pass ever holds the full [B, T, V] array (the backward recomputes one
chunk's logits at a time). By default the chunk is the largest power of two whose logits fit
in `DEFAULT_CHUNK_BYTES` (`auto_chunk_size`): fewer, larger chunks are faster, and the budget
bounds the memory. The batch axis is never reshaped, so a batch sharded over the data
axes stays sharded; a vocab-sharded unembedding stays vocab-sharded (XLA reduces the
logsumexp across shards).

Work: `where_bt` (e.g. a loss mask) names the positions whose log-probs are wanted. Each row's
wanted positions are moved to its front (a stable per-row permutation, undone on the way out,
forward and backward), and a chunk past every row's count skips the vocabulary projection
(`lax.cond`). Prompts and tool outputs carry no loss, so an RL batch typically does a half or
less of the [B, T, V] work; the other positions read 0.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from steprl_jax.ops.matmul import mixed_einsum

# Budget for one chunk's float32 logits [B, chunk, V]. 256 MiB gives 512 positions for a
# 2-row SmolLM2 micro-batch (a train step ~5% faster on CPU than with 128-position chunks) and
# 128 for 8 rows.
DEFAULT_CHUNK_BYTES = 256 << 20


def auto_chunk_size(batch: int, length: int, vocab: int,
                    budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The largest power of two (at least 16, at most `length`) of positions whose float32
    logits [batch, chunk, vocab] fit in `budget_bytes`."""
    fit = max(int(budget_bytes) // (4 * batch * vocab), 1)
    return max(1, min(max(16, 1 << (fit.bit_length() - 1)), length))


def _check_inputs(hidden_btd, unembed_vd, targets_bt, temperature, final_softcap, chunk_size):
    if hidden_btd.ndim != 3:
        raise ValueError(f"hidden_btd must be [batch, length, hidden], got shape {hidden_btd.shape}")
    if unembed_vd.ndim != 2:
        raise ValueError(f"unembed_vd must be [vocab, hidden], got shape {unembed_vd.shape}")
    if targets_bt.shape != hidden_btd.shape[:2]:
        raise ValueError(
            f"targets_bt shape {targets_bt.shape} does not match hidden_btd batch/length "
            f"{hidden_btd.shape[:2]}")
    if unembed_vd.shape[1] != hidden_btd.shape[2]:
        raise ValueError(
            f"hidden size mismatch: hidden_btd has {hidden_btd.shape[2]}, unembed_vd has "
            f"{unembed_vd.shape[1]}")
    if not jnp.issubdtype(targets_bt.dtype, jnp.integer):
        raise ValueError(f"targets_bt must be integer token ids, got dtype {targets_bt.dtype}")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if final_softcap is not None and not final_softcap > 0:
        raise ValueError(f"final_softcap must be None or > 0, got {final_softcap}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be None (automatic) or >= 1, got {chunk_size}")


def scaled_logits(hidden_bcd, unembed_vd, *, temperature=1.0, final_softcap=None,
                  compute_dtype=None):
    """float32 `softcap(h @ W.T) / temperature` for one chunk: [..., D] -> [..., V].

    `compute_dtype` (e.g. jnp.bfloat16) casts both operands for the matmul, forward and
    backward (`ops.matmul.mixed_einsum`); accumulation is float32 either way.
    """
    if compute_dtype is None:
        logits = jnp.einsum("...d,vd->...v", hidden_bcd, unembed_vd,
                            preferred_element_type=jnp.float32).astype(jnp.float32)
    else:
        lead = hidden_bcd.shape[:-1]
        logits = mixed_einsum("nd,vd->nv", hidden_bcd.reshape(-1, hidden_bcd.shape[-1]),
                              unembed_vd, compute_dtype).reshape(*lead, unembed_vd.shape[0])
    if final_softcap is not None:
        logits = final_softcap * jnp.tanh(logits / final_softcap)
    return logits / temperature


def _chunk_stats(hidden_bcd, targets_bc, unembed_vd, temperature, final_softcap, compute_dtype,
                 with_entropy):
    z_bcv = scaled_logits(hidden_bcd, unembed_vd, temperature=temperature,
                          final_softcap=final_softcap, compute_dtype=compute_dtype)
    return stats_from_scaled_logits(z_bcv, targets_bc, with_entropy)


def stats_from_scaled_logits(z_bcv, targets_bc, with_entropy: bool = False):
    """(log-probs, entropies or zeros) of `targets_bc` from `scaled_logits` output [..., V].

    The second half of `token_logprobs`, for a caller that already holds the logits (the
    sampler's decode step, which also samples from them).
    """
    lse_bc = jax.nn.logsumexp(z_bcv, axis=-1)
    z_target_bc = jnp.take_along_axis(z_bcv, targets_bc[..., None], axis=-1)[..., 0]
    logp_bc = z_target_bc - lse_bc
    if not with_entropy:
        return logp_bc, jnp.zeros_like(logp_bc)
    # -sum p log p on the shifted logits: no cancellation between two large numbers.
    logsm_bcv = z_bcv - lse_bc[..., None]
    entropy_bc = -jnp.sum(jnp.exp(logsm_bcv) * logsm_bcv, axis=-1)
    return logp_bc, entropy_bc


@jax.custom_vjp
def _take_rows(x_btd, order_bt, inverse_bt):
    """x[b, order[b, t]] for a per-row permutation `order` with inverse `inverse`; the backward
    is the inverse gather (a permutation's transpose), not a scatter-add."""
    return jnp.take_along_axis(x_btd, order_bt.reshape(*order_bt.shape, *[1] * (x_btd.ndim - 2)),
                               axis=1)


def _take_rows_fwd(x_btd, order_bt, inverse_bt):
    return _take_rows(x_btd, order_bt, inverse_bt), (order_bt, inverse_bt)


def _take_rows_bwd(res, g_btd):
    order_bt, inverse_bt = res
    return _take_rows(g_btd, inverse_bt, order_bt), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def token_logprobs(hidden_btd: jax.Array, unembed_vd: jax.Array, targets_bt: jax.Array, *,
                   temperature: float | jax.Array = 1.0, final_softcap: Optional[float] = None,
                   chunk_size: Optional[int] = None, with_entropy: bool = False,
                   compute_dtype=None, where_bt: Optional[jax.Array] = None):
    """float32 log pi(targets | hidden) per position, plus entropies if `with_entropy`.

    Args:
      hidden_btd: final-normed hidden states [B, T, D] (T may be 1 for decoding).
      unembed_vd: unembedding [V, D] (the embedding table when tied).
      targets_bt: int token ids [B, T] whose log-probs are wanted.
      temperature: log-softmax is taken of `logits / temperature` (scalar, may be traced).
      final_softcap: the model's final-logit softcap, or None.
      chunk_size: sequence positions per chunk; peak extra memory is ~B*chunk*V*4 bytes x a few.
        None: `auto_chunk_size` (a 256 MiB budget for one chunk's logits).
      with_entropy: also return the entropy of softmax(logits / temperature).
      compute_dtype: matmul operand dtype (None: as given); accumulation is always float32.
      where_bt: optional bool [B, T], the positions whose values are wanted; the others are 0
        and cost nothing once a whole chunk is free of wanted positions (see the module
        docstring). With it, the automatic chunk is at most a quarter of the row, so that
        skipping has something to skip. Under `vmap` the skip becomes a select (no saving).

    Returns:
      logp_bt float32 [B, T], or (logp_bt, entropy_bt) when `with_entropy`.
    """
    _check_inputs(hidden_btd, unembed_vd, targets_bt, temperature, final_softcap, chunk_size)
    b, t, _ = hidden_btd.shape

    def stats(hidden_bcd, targets_bc):
        return _chunk_stats(hidden_bcd, targets_bc, unembed_vd, temperature, final_softcap,
                            compute_dtype, with_entropy)

    if where_bt is None:
        if chunk_size is None:
            chunk_size = auto_chunk_size(b, t, unembed_vd.shape[0])
        logp_bt, entropy_bt = _chunked(stats, hidden_btd, targets_bt, int(chunk_size))
        return (logp_bt, entropy_bt) if with_entropy else logp_bt
    if tuple(where_bt.shape) != (b, t):
        raise ValueError(f"where_bt shape {tuple(where_bt.shape)} does not match "
                         f"hidden_btd batch/length {(b, t)}")
    if chunk_size is None:
        chunk_size = min(auto_chunk_size(b, t, unembed_vd.shape[0]), max(16, t // 4))
    where_bt = jnp.asarray(where_bt).astype(bool)
    # Wanted positions first, in their order (a stable sort of 0/1 keys); integer work only.
    order_bt = jnp.argsort(jnp.logical_not(where_bt), axis=1, stable=True).astype(jnp.int32)
    inverse_bt = jnp.argsort(order_bt, axis=1).astype(jnp.int32)
    counts_b = jnp.sum(where_bt, axis=1)
    logp_bt, entropy_bt = _chunked(stats, _take_rows(hidden_btd, order_bt, inverse_bt),
                                   jnp.take_along_axis(targets_bt, order_bt, axis=1),
                                   int(chunk_size), count=jnp.max(counts_b))
    kept_bt = jnp.arange(t)[None, :] < counts_b[:, None]  # the sorted rows' wanted prefix

    def unsort(x_bt):
        return _take_rows(jnp.where(kept_bt, x_bt, 0.0), inverse_bt, order_bt)

    return (unsort(logp_bt), unsort(entropy_bt)) if with_entropy else unsort(logp_bt)


def _chunked(stats, hidden_btd, targets_bt, chunk_size: int, count=None):
    """`stats(hidden_bcd, targets_bc) -> (logp_bc, entropy_bc)` over chunks of `chunk_size`
    positions, each under `jax.checkpoint` (one chunk's logits live at a time, forward and
    backward). With `count`, a chunk starting at or past position `count` is skipped (0)."""
    b, t, d = hidden_btd.shape
    c = min(chunk_size, t)
    n_chunks = -(-t // c)
    pad = n_chunks * c - t
    if pad:
        hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
        targets_bt = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    # [n_chunks, B, c, ...]: scan over the chunk axis, batch axis untouched.
    hidden_nbcd = jnp.moveaxis(hidden_btd.reshape(b, n_chunks, c, d), 1, 0)
    targets_nbc = jnp.moveaxis(targets_bt.reshape(b, n_chunks, c), 1, 0)
    starts_n = jnp.arange(n_chunks, dtype=jnp.int32) * c

    def skip(hidden_bcd, targets_bc):
        zeros = jnp.zeros(targets_bc.shape, jnp.float32)
        return zeros, zeros

    @jax.checkpoint
    def body(hidden_bcd, targets_bc, start):
        if count is None:
            return stats(hidden_bcd, targets_bc)
        return jax.lax.cond(start < count, stats, skip, hidden_bcd, targets_bc)

    if n_chunks == 1:
        out_nbc = jax.tree.map(lambda x: x[None], body(hidden_nbcd[0], targets_nbc[0], starts_n[0]))
    else:
        _, out_nbc = jax.lax.scan(lambda carry, xs: (carry, body(*xs)), None,
                                  (hidden_nbcd, targets_nbc, starts_n))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, n_chunks * c)[:, :t] for x in out_nbc)


def naive_token_logprobs(hidden_btd, unembed_vd, targets_bt, *, temperature=1.0,
                         final_softcap=None, with_entropy=False, compute_dtype=None):
    """Reference path that materialises [B, T, V] float32 logits (tests and benchmarks only)."""
    _check_inputs(hidden_btd, unembed_vd, targets_bt, temperature, final_softcap, 1)
    return_val = _chunk_stats(hidden_btd, targets_bt, unembed_vd, temperature, final_softcap,
                              compute_dtype, with_entropy)
    return return_val if with_entropy else return_val[0]
