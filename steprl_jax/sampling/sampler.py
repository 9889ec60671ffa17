"""A jitted KV-cache sampler for multi-step, tree-shaped agent rollouts.

    sampler = Sampler(model, tokenizer)
    state = sampler.prefill(prompt_ids)                       # list of token-id lists
    state, gens = sampler.generate(state, key, max_new_tokens=256,
                                   stop=("</tool_call>",))   # one jitted loop per call
    state = sampler.append(state, tool_response_ids)          # cost ~ new tokens only
    state = sampler.fork(state, [0, 0, 0, 1, 1, 1])           # rows copied, no recompute
    state, gens = sampler.generate(state, key, ...)           # each row its own PRNG stream

State. A `SamplerState` holds, per row, the KV cache of every token but the last, and that last
("pending") token, which the next call feeds first. So `generate` runs exactly one `extend`
of one token per step (feed the pending token, sample the next one, which becomes pending),
`append` of n tokens costs one `extend` of n tokens, and a fork is a row gather. All rows of a
batch write the same cache slot (see `KVCache`); a row with fewer new tokens writes empty slots
(position -1) that attention ignores. Slots are order-free (positions are applied by RoPE
before caching), so `compact` can squeeze out those empty slots when the cache would
otherwise have to grow.

Shared prefix. When the prompts of a `prefill` share at least `min_shared_prefix` tokens (a
system prompt, a tool list, worked examples), those are computed once into a `SharedKV`
segment that every row continues; each row's cache holds only what follows it, and attention
reads the segment once per step for all rows (`models.attention.attention_with_shared`), not
once per row. `insert` starts later prompts that begin with the segment on it too. With 16
rows whose ~1,450-token prompts share ~1,300 tokens, a decode step reads ~5x fewer keys.

Calls consume their input state: its cache buffers are donated to the next program and
updated in place. Keep a copy with `fork(state, range(n))` if you need the old one.

Compilation. Every jitted function takes one frozen program dataclass (`ExtendProgram`,
`DecodeProgram`) as its static argument. Batch, new-token and cache lengths are rounded up to
buckets (`params.bucket`: powers of two and 1.5x powers of two), so a long run compiles a
handful of programs; each new program is logged at debug level with a running count
(`Sampler.num_compiled`).

Randomness. `generate(state, key)` gives row b the key `fold_in(key, b)` (or takes one key
per row), and the token a row samples at its step t uses `fold_in(row_key, t)`: a row's random
draws depend on its key only — not on the batch size, padding, or the other rows. So f forked
rows given the keys k_1..k_f produce what f separate runs from the same prefix with those keys
produce, up to float rounding: a row's logits differ in their last bits with the batch width,
the cache length and which slots hold its keys (all rows share the slot index, so the other
rows' history decides that), and a draw that lands within that rounding of a token boundary
takes the neighbouring token. The values of the other rows do not matter, nor the row's place.

Log-probs. Recorded with `steprl_jax.ops.logprobs` (`scaled_logits`, then
`stats_from_scaled_logits`, the two halves of the trainer's `token_logprobs`) on the decode
step's hidden state: log_softmax(softcap(h @ W.T) / temperature) in float32, the untruncated
tempered distribution (see `SamplingParams`), exactly the trainer's definition; the logits
are computed once per step for both sampling and the log-prob.

Precision. With `compute_dtype="bfloat16"`, the matmul weights (q, k, v, o, gate, up, down,
the unembedding) are cast to bf16 once when the sampler takes the parameters, not per step;
norms, biases and the embedding lookup stay float32. The model casts matmul operands to bf16
anyway, so this changes no value — the sampler's numbers match the trainer's.

Memory. The cache is allocated for the bucketed length, in the compute dtype, one [B, K, S, H]
buffer per layer for keys and one for values:
    2 (k, v) x L x B x S x K x H x bytes(compute dtype) + 4 B x S (slot positions)
e.g. SmolLM2-135M (L=30, K=3, H=64) in bf16: 23 KiB per token, so a batch of 32 rows with
S = 2,048 slots costs 1.5 GB (float32: twice that). A decode step additionally holds
[B, V] float32 logits; a prefill chunk [B, N, T, S] float32 attention logits for one layer.

Sharding. With a `mesh`, parameters should already be placed (`models.sharding.shard_model`);
the cache, tokens and keys are sharded over the batch axes of the rules table (`batch_sharding`)
and batch buckets are multiples of the data-parallel size.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from steprl_jax.models import fused_attention
from steprl_jax.models.fused_attention import traced_under
from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, state_shardings
from steprl_jax.models.transformer import KVCache, SharedKV, Transformer
from steprl_jax.ops.logprobs import scaled_logits, stats_from_scaled_logits
from steprl_jax.sampling import stop as stop_lib
from steprl_jax.sampling.params import (
    CONTEXT, EOS, FINISH_REASONS, LENGTH, RUNNING, STOP, DecodeProgram, ExtendProgram, Generation,
    SamplingParams)
from steprl_jax.shapes import bucket

log = logging.getLogger(__name__)

# Parameters used only as matmul operands: cast once to the compute dtype.
_MATMUL_WEIGHTS = frozenset({"q", "k", "v", "o", "gate", "up", "down"})


class ContextOverflowError(ValueError):
    """Appending tokens would take a row past the context limit."""


@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Rows being generated: their KV cache, pending last token, and lengths.

    `cache` and `last_token` have the bucketed batch size (rows >= `num_rows` are padding);
    `lengths[b]` counts row b's tokens including the pending one; `index` is the next cache slot
    (host copy of `cache.index`, so capacity checks never sync with the device); `last_host` is
    the host's copy of the pending tokens (so `append` never reads them back from the device).
    `shared`: the prompt prefix rows may continue (see the module docstring), its tokens
    `shared_ids`, and which rows continue it (`row_shared`, host copy of `cache.row_shared`).
    `free_below[b]`: slots [0, free_below[b]) of row b are known to be empty (a compaction or an
    insert left them so), where an append to a few rows can go without widening the others.
    """

    cache: KVCache
    last_token: jax.Array  # [B_bucket] int32
    lengths: np.ndarray  # [num_rows] int64, host
    index: int
    last_host: np.ndarray  # [num_rows] int64, host
    shared: Optional[SharedKV] = None
    shared_ids: Optional[np.ndarray] = None  # [P] int64, host
    row_shared: Optional[np.ndarray] = None  # [num_rows] bool, host
    free_below: Optional[np.ndarray] = None  # [num_rows] int64, host; None: none known

    def free_slots(self) -> np.ndarray:
        return np.zeros(self.num_rows, np.int64) if self.free_below is None else self.free_below

    @property
    def shared_length(self) -> int:
        """Tokens in the shared segment (0: none)."""
        return 0 if self.shared is None else len(self.shared_ids)

    @property
    def shared_slots(self) -> int:
        """Slots of the shared segment, which attention reads beside each row's own (0: none)."""
        return 0 if self.shared is None else self.shared.pos.shape[0]

    def slots_held(self) -> np.ndarray:
        """Cache slots each row fills: its tokens but the pending one, less the shared segment's."""
        held = self.lengths - 1
        if self.shared is not None:
            held = held - self.shared_length * self.row_shared
        return np.maximum(held, 0)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def batch_bucket(self) -> int:
        return self.last_token.shape[0]

    @property
    def cache_length(self) -> int:
        return self.cache.length

    def cache_bytes(self) -> int:
        return self.cache.bytes() + (0 if self.shared is None else self.shared.bytes())


def is_matmul_weight(path) -> bool:
    """Whether the parameter at `path` (a pytree key path) is only a matmul operand, kept by
    the sampler in the compute dtype."""
    names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
    return "layers" in names and names[-1] in _MATMUL_WEIGHTS or names[-1] == "lm_head"


def extend_chunk(prefill_chunk: int, attention_bytes: int, min_extend: int, batch: int, heads: int,
                 slots: int) -> int:
    """Tokens per `extend` chunk: at most `prefill_chunk`, and few enough that one layer's
    float32 logits [batch, heads, chunk, slots] stay under `attention_bytes` (a power of two, at
    least `min_extend`)."""
    fits = attention_bytes // (4 * batch * heads * slots)
    return max(min_extend, min(prefill_chunk, 1 << max(int(fits), 1).bit_length() - 1))


# ----------------------------------------------------------------------------- sharding
def _batch_axes(mesh, rules: dict):
    axes = rules["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if a in mesh.shape)
    return (axes if len(axes) > 1 else axes[0]) if axes else None, axes


def data_parallel(mesh, rules: dict = LOGICAL_AXIS_RULES) -> int:
    """How many ways the sampler's rows split over `mesh` (batch buckets are multiples of it)."""
    axes = _batch_axes(mesh, rules)[1]
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def cache_shardings(mesh, rules: dict, num_kv_heads: int) -> tuple:
    """(rows [B], rows [B, S], kv buffers [B, K, S, H], scalars) on the sampler's `mesh`: rows
    over the batch axes, kv heads over the rules' kv-heads axis when it divides them (a
    tensor-parallel sampler keeps 1/tensor of the cache per device, not a full copy)."""
    batch, _ = _batch_axes(mesh, rules)
    heads = rules.get("kv_heads")
    heads = heads if isinstance(heads, str) and heads in mesh.shape and mesh.shape[heads] > 1 else None
    heads = heads if heads and num_kv_heads % mesh.shape[heads] == 0 else None
    return (NamedSharding(mesh, PartitionSpec(batch)), NamedSharding(mesh, PartitionSpec(batch, None)),
            NamedSharding(mesh, PartitionSpec(batch, heads, None, None)), NamedSharding(mesh, PartitionSpec()))


def constrain_cache(shardings: tuple, cache: KVCache) -> KVCache:
    """`cache` constrained to `cache_shardings` (inside the jitted programs)."""
    row, row2, kv, _ = shardings
    wsc = jax.lax.with_sharding_constraint
    return cache._replace(k=tuple(wsc(k, kv) for k in cache.k), v=tuple(wsc(v, kv) for v in cache.v),
                          slot_pos=wsc(cache.slot_pos, row2),
                          row_shared=None if cache.row_shared is None else wsc(cache.row_shared, row))


# ----------------------------------------------------------------------------- jitted kernels
def _extend_impl(graphdef, constrain, params, layer_params, cache, ids_bt, pos_bt, shared=None, *,
                 program: ExtendProgram):
    model = nnx.merge(graphdef, params)
    _, cache = model.extend(ids_bt, pos_bt, cache, layer_params, fresh=program.fresh, shared=shared)
    return constrain(cache)


def _take_rows_impl(constrain, rows, cache, last_token):
    cache = cache.take_rows(rows)
    return constrain(cache), last_token[rows]


def _clear_impl(constrain, mask_b, cache):
    row_shared = None if cache.row_shared is None else cache.row_shared & ~mask_b  # they hold nothing
    return constrain(cache._replace(slot_pos=jnp.where(mask_b[:, None], -1, cache.slot_pos), row_shared=row_shared))


def _write_rows_impl(constrain, width: int, cache, last_b, src, src_last, target_rows, clear_b, at, src_at):
    """Rows `target_rows[j]` of `cache` take `src` row j's slots [src_at, src_at + width), written at
    [at, at + width), and its pending token (targets >= the batch: dropped). Rows in `clear_b`
    are emptied first. The other rows' slots there are kept as they are. With a shared segment,
    the targets continue it as their `src` rows do (not at all when `src` has none)."""
    def put(big, small, axis):
        region = jax.lax.dynamic_slice_in_dim(big, at, width, axis=axis)
        new = jax.lax.dynamic_slice_in_dim(small, src_at, width, axis=axis)
        region = region.at[target_rows].set(new.astype(big.dtype), mode="drop")
        return jax.lax.dynamic_update_slice_in_dim(big, region, at, axis=axis)

    slot_pos = put(jnp.where(clear_b[:, None], -1, cache.slot_pos), src.slot_pos, 1)
    k = tuple(put(x, y, 2) for x, y in zip(cache.k, src.k))
    v = tuple(put(x, y, 2) for x, y in zip(cache.v, src.v))
    last_b = last_b.at[target_rows].set(src_last, mode="drop")
    row_shared = cache.row_shared
    if row_shared is not None:
        src_shared = jnp.zeros(src.slot_pos.shape[0], bool) if src.row_shared is None else src.row_shared
        row_shared = row_shared.at[target_rows].set(src_shared, mode="drop")
    index = jnp.maximum(cache.index, at + width).astype(jnp.int32)
    return constrain(cache._replace(k=k, v=v, slot_pos=slot_pos, index=index, row_shared=row_shared)), last_b


def _resize_impl(constrain, new_length: int, cache):
    pad = new_length - cache.length
    widths = ((0, 0), (0, 0), (0, pad), (0, 0))
    return constrain(cache._replace(k=tuple(jnp.pad(k, widths) for k in cache.k),
                                    v=tuple(jnp.pad(v, widths) for v in cache.v),
                                    slot_pos=jnp.pad(cache.slot_pos, ((0, 0), (0, pad)), constant_values=-1)))


def _compact_impl(constrain, new_length: int, cache):
    """Move each row's filled slots to the end of [0, n_max), n_max = max filled; drop the rest."""
    filled_bs = cache.slot_pos >= 0
    count_b = filled_bs.sum(axis=1)
    n_max = count_b.max()
    rank_bs = jnp.cumsum(filled_bs, axis=1) - 1  # rank of each filled slot within its row
    target_bs = jnp.where(filled_bs, n_max - count_b[:, None] + rank_bs, new_length)  # drop others
    b_idx = jnp.arange(cache.slot_pos.shape[0])[:, None]
    # source slot for each target slot: scatter the slot indices to their targets.
    src_bs = jnp.full((cache.slot_pos.shape[0], new_length), cache.length, jnp.int32)
    src_bs = src_bs.at[b_idx, target_bs].set(jnp.arange(cache.length, dtype=jnp.int32)[None], mode="drop")
    valid_bs = src_bs < cache.length
    src_bs = jnp.minimum(src_bs, cache.length - 1)
    k = tuple(jnp.take_along_axis(x, src_bs[:, None, :, None], axis=2) for x in cache.k)
    v = tuple(jnp.take_along_axis(x, src_bs[:, None, :, None], axis=2) for x in cache.v)
    slot_pos = jnp.where(valid_bs, jnp.take_along_axis(cache.slot_pos, src_bs, axis=1), -1)
    return constrain(cache._replace(k=k, v=v, slot_pos=slot_pos, index=n_max.astype(jnp.int32)))


def _filter_logits(program: DecodeProgram, z_bv, top_p):
    """Returns (candidate logits [B, C], candidate token ids [B, C] or None for the full vocab)."""
    if program.top_k:
        z_bc, ids_bc = jax.lax.top_k(z_bv, program.top_k)
    elif program.top_p:
        ids_bc = jnp.argsort(-z_bv, axis=-1)
        z_bc = jnp.take_along_axis(z_bv, ids_bc, axis=-1)
    else:
        return z_bv, None
    if program.top_p:
        probs_bc = jax.nn.softmax(z_bc, axis=-1)  # sorted, descending
        mass_before_bc = jnp.cumsum(probs_bc, axis=-1) - probs_bc
        z_bc = jnp.where(mass_before_bc < top_p, z_bc, -jnp.inf)  # always keeps the first
    return z_bc, ids_bc


# Vocabulary block of the two-level inverse-CDF draw (`draw_tokens`).
DRAW_BLOCK = 256


def draw_tokens(keys_b, z_bc, block: int = DRAW_BLOCK):
    """One token per row from softmax(z_bc) [B, C], by inverse-CDF sampling in two levels, each
    with its own uniform from the row's key: a block of `block` candidates by the blocks' masses,
    then a candidate of that block by its tokens' masses.

    Why not `jax.random.categorical`: its Gumbel-max draws C random numbers and two logs per
    row and step; for SmolLM2's 49,152-token vocabulary at 64 rows that took 47 ms of a ~120 ms
    decode step on a 2-core CPU, this ~5 ms. Same distribution (FlashInfer's sampler draws the
    same way); other tokens for a given key than `categorical`.

    Two levels keep float32 cumulative sums short: the blocks' masses first, then the tokens of
    the chosen block (`block` at a time). The second level draws a fresh uniform against the
    block's own mass rather than what is left of the first one (u * total - the blocks before):
    that remainder is a difference of two sums of the whole row's size, whose float32 steps
    (4e-3 for a flat row of SmolLM2's 49,152 candidates, each of mass ~1) are large against
    one candidate, so tiny differences in the logits or in the order of the sums (another batch
    size, another device count) moved a draw to a neighbouring token: for logits off by 1e-5
    (1e-4), 22 (43) of 8,192 draws, now 0 (5). Candidates with probability 0 (top-k / top-p
    cut, -inf logits) are never drawn, rounding included: the index is clipped to the first and
    last positive candidate of the row and of the chosen block.
    """
    B, C = z_bc.shape
    p_bc = jnp.exp(z_bc - jnp.max(z_bc, axis=-1, keepdims=True))
    n = -(-C // block)
    p_bnk = jnp.pad(p_bc, ((0, 0), (0, n * block - C))).reshape(B, n, block)

    def pick(weights_bw, target_b):
        """The index of the first weight whose running sum exceeds target, clipped to the
        positive ones (rounding can put the target at or past the last running sum)."""
        cum_bw = jnp.cumsum(weights_bw, axis=-1)
        idx = jnp.sum(cum_bw <= target_b[:, None], axis=-1)
        w = jnp.arange(weights_bw.shape[1])
        positive = weights_bw > 0
        first = jnp.min(jnp.where(positive, w, weights_bw.shape[1]), axis=-1)
        last = jnp.max(jnp.where(positive, w, -1), axis=-1)
        return jnp.clip(idx, first, last)

    mass_bn = jnp.sum(p_bnk, axis=-1)
    u_b2 = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys_b)
    blk_b = pick(mass_bn, u_b2[:, 0] * jnp.sum(mass_bn, axis=-1))
    inner_bk = jnp.take_along_axis(p_bnk, blk_b[:, None, None], axis=1)[:, 0]
    blk_mass_b = jnp.take_along_axis(mass_bn, blk_b[:, None], axis=1)[:, 0]
    tok_b = pick(inner_bk, u_b2[:, 1] * blk_mass_b)
    return (blk_b * block + tok_b).astype(jnp.int32)


def _decode_impl(graphdef, constrain, params, layer_params, unembed_vd, cache, last_b, length_b, max_new_b, keys_b,
                 n0_b, auto0_b, limit, return_on_finish, temperature, top_p, stop_table, shared=None, *,
                 program: DecodeProgram):
    """Decode until every row is done, or `limit` steps, or (`return_on_finish`) a row finishes.
    A row resumes an action of `n0_b` tokens in stop-automaton state `auto0_b`; rows still
    running at the end keep reason RUNNING unless the cache ran out of slots (CONTEXT)."""
    model = nnx.merge(graphdef, params)
    config = model.config
    B, M = program.batch, program.max_new
    compute_dtype = jnp.dtype(config.compute_dtype)
    slots = cache.length - cache.index
    steps = jnp.minimum(jnp.minimum(M, limit), slots)
    stop_ids = jnp.asarray(program.stop_ids or (-1,), jnp.int32)
    done0 = max_new_b <= n0_b
    carry0 = dict(
        i=jnp.zeros((), jnp.int32), cache=cache, tok=last_b, length=length_b, done=done0, finished=jnp.bool_(False),
        auto=auto0_b, n=n0_b, reason=jnp.where(done0, LENGTH, RUNNING).astype(jnp.int32),
        out_tok=jnp.zeros((B, M), jnp.int32), out_lp=jnp.zeros((B, M), jnp.float32),
        out_ent=jnp.zeros((B, M if program.with_entropy else 0), jnp.float32))

    def cond(c):
        return (c["i"] < steps) & ~jnp.all(c["done"]) & ~(return_on_finish & c["finished"])

    def body(c):
        active_b = ~c["done"]
        pos_b = jnp.where(active_b, c["length"] - 1, -1)
        hidden_b1d, new_cache = model.extend(c["tok"][:, None], pos_b[:, None], c["cache"], layer_params,
                                             shared=shared)
        z_bv = scaled_logits(hidden_b1d[:, 0], unembed_vd, temperature=temperature,
                             final_softcap=config.final_logit_softcap, compute_dtype=compute_dtype)
        if program.greedy:
            new_b = jnp.argmax(z_bv, axis=-1).astype(jnp.int32)
        else:
            step_keys = jax.vmap(jax.random.fold_in)(keys_b, c["n"])
            z_bc, ids_bc = _filter_logits(program, z_bv, top_p)
            choice_b = draw_tokens(step_keys, z_bc)
            new_b = choice_b if ids_bc is None else jnp.take_along_axis(ids_bc, choice_b[:, None], 1)[:, 0]
        lp_b, ent_b = stats_from_scaled_logits(z_bv, new_b, program.with_entropy)
        rows = jnp.arange(B)
        col_b = jnp.where(active_b, c["n"] - n0_b, M)  # finished rows write out of bounds: dropped
        out = dict(out_tok=c["out_tok"].at[rows, col_b].set(new_b, mode="drop"),
                   out_lp=c["out_lp"].at[rows, col_b].set(lp_b, mode="drop"))
        out["out_ent"] = (c["out_ent"].at[rows, col_b].set(ent_b, mode="drop")
                          if program.with_entropy else c["out_ent"])
        n_b = c["n"] + active_b
        length = c["length"] + active_b
        tok = jnp.where(active_b, new_b, c["tok"])
        if program.stop_states:
            auto_b = stop_table[jnp.clip(c["auto"], 0, None), new_b]
            hit_stop = auto_b < 0
        else:
            auto_b, hit_stop = c["auto"], jnp.zeros((B,), bool)
        hit_eos = jnp.any(new_b[:, None] == stop_ids[None, :], axis=-1)
        reason_now = jnp.select(
            [hit_stop, hit_eos, n_b >= max_new_b, length >= program.max_context],
            [STOP, EOS, LENGTH, CONTEXT], RUNNING).astype(jnp.int32)
        finished = active_b & (reason_now != RUNNING)
        return dict(
            i=c["i"] + 1, cache=constrain(new_cache), tok=tok, length=length,
            done=c["done"] | finished, finished=c["finished"] | jnp.any(finished),
            auto=jnp.where(active_b, auto_b, c["auto"]), n=n_b,
            reason=jnp.where(finished, reason_now, c["reason"]), **out)

    c = jax.lax.while_loop(cond, body, carry0)
    # Rows still running when the cache ran out of slots finish with reason `context`.
    out_of_slots = (c["i"] >= slots) & (slots < jnp.minimum(M, limit))
    reason = jnp.where(c["done"], c["reason"], jnp.where(out_of_slots, CONTEXT, RUNNING))
    return (c["cache"], c["tok"], c["out_tok"], c["out_lp"], c["out_ent"], c["n"], c["auto"], reason)


class _Weights(NamedTuple):
    """What the sampler samples with: the cast parameters (stacked layers emptied), one dict per
    layer, the unembedding, and the policy version they are."""

    params: Any
    layers: Any
    unembed: jax.Array
    version: int


def jitted_programs(graphdef, mesh, constrain) -> tuple:
    """(extend, decode, take_rows): the sampler's jitted prefill/append, decode-loop and fork
    programs, traced under `mesh` (the fused kernels read it there); the caches they take are
    donated. One place for the Sampler and for the plans that compile its programs."""
    extend = jax.jit(traced_under(mesh, functools.partial(_extend_impl, graphdef, constrain)),
                     static_argnames="program", donate_argnames="cache")
    decode = jax.jit(traced_under(mesh, functools.partial(_decode_impl, graphdef, constrain)),
                     static_argnames="program", donate_argnames="cache")
    return extend, decode, jax.jit(functools.partial(_take_rows_impl, constrain))


class _Programs:
    """Every jitted program of a sampler over one architecture, mesh and cache sharding."""

    __slots__ = ("extend", "decode", "take_rows", "resize", "clear", "write_rows", "compact", "unstack", "segment",
                 "__weakref__")

    def __init__(self, graphdef, mesh, shardings: Optional[tuple]):
        constrain = _identity if shardings is None else functools.partial(constrain_cache, shardings)
        self.extend, self.decode, self.take_rows = jitted_programs(graphdef, mesh, constrain)
        self.resize = jax.jit(functools.partial(_resize_impl, constrain), static_argnums=0)
        self.clear = jax.jit(functools.partial(_clear_impl, constrain), donate_argnums=1)
        self.write_rows = jax.jit(functools.partial(_write_rows_impl, constrain), static_argnums=0,
                                  donate_argnums=(1, 2))
        self.compact = jax.jit(functools.partial(_compact_impl, constrain), static_argnums=0)
        self.unstack = jax.jit(lambda state: nnx.merge(graphdef, state).layers.unstacked())
        self.segment = jax.jit(SharedKV.from_row, static_argnums=(1, 2))


# The live samplers' programs by (graphdef, mesh, cache shardings): a sampler made while another of
# the same architecture lives (an evaluation's beside the rollouts', a frozen model's beside the
# policy's) neither traces nor compiles again what the other did (jit caches live on the jitted
# functions). Weak: the compiled programs go with the last sampler that uses them.
_LIVE_PROGRAMS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_LIVE_PROGRAMS_LOCK = threading.Lock()


def _shared_programs(graphdef, mesh, shardings: Optional[tuple]) -> _Programs:
    key = (graphdef, mesh, shardings)
    with _LIVE_PROGRAMS_LOCK:
        programs = _LIVE_PROGRAMS.get(key)
        if programs is None:
            programs = _LIVE_PROGRAMS[key] = _Programs(graphdef, mesh, shardings)
        return programs


# ----------------------------------------------------------------------------- the sampler
class Sampler:
    """Prefill / generate / append / fork over a `Transformer`, with bucketed, jitted programs.

    Args:
      model: the NNX `Transformer` (parameters possibly sharded over `mesh`).
      tokenizer: optional; needed for stop strings and returned text (see
        `stop.token_bytes_table` for what is accepted).
      mesh: optional `jax.sharding.Mesh`; the batch is sharded over the rules' batch axes.
      max_context: positions per row (default: `config.max_position_embeddings`).
      max_cache_length: the most slots a cache may grow to (default: the bucket of
        `max_context`); above it the cache is compacted, and rows that still do not fit finish
        with reason `context`.
      prefill_chunk: prompts (and appended tokens) are fed in chunks of at most this many
        tokens, which bounds both activation memory and the number of compiled programs
        (on XLA:CPU with SmolLM2, 1,550 tokens: 512 -> 11.9 s, 256 -> 14.6 s, 2048 -> 19.5 s).
      prefill_attention_bytes: chunks are also cut so that one layer's float32 attention
        logits, B x N x T x S x 4 bytes, stay under this (each chunk attends over all S slots,
        so fewer, longer chunks waste less work on empty slots).
      min_cache_length, min_extend_length: smallest buckets.
      min_shared_prefix: when all prompts of a `prefill` start with the same tokens (a system
        prompt, few-shot examples, a group of identical prompts), and at least this many, the
        shared prefix is computed once and held once, as a segment every row attends over
        (see "Shared prefix" above); 0 turns this off.
      min_decode_batch: `generate` decodes at least this many rows, padding a narrower state
        with empty rows (a copy of its cache rows, once per call). Default: 2 for a
        low-precision compute dtype on the CPU backend, else 1. XLA:CPU runs a one-row bf16
        product through a slow float32 fallback (SmolLM2's unembedding: 45 ms for one row,
        3.4 ms for two), while two rows take its fast bf16 kernel and read half the bytes of
        float32 (greedy batch-1 decode: 32 -> 40 tok/s).
    """

    def __init__(self, model: Transformer, tokenizer=None, *, mesh=None, rules: dict = LOGICAL_AXIS_RULES,
                 max_context: Optional[int] = None, max_cache_length: Optional[int] = None,
                 prefill_chunk: int = 512, prefill_attention_bytes: int = 1 << 30,
                 min_cache_length: int = 128, min_extend_length: int = 16, min_shared_prefix: int = 32,
                 min_decode_batch: Optional[int] = None):
        self.config = model.config
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.rules = rules
        self.max_context = int(max_context or self.config.max_position_embeddings)
        self.max_cache_length = int(max_cache_length or bucket(self.max_context, min_cache_length))
        if self.max_cache_length < self.max_context // 2:
            log.info("max_cache_length %d is below max_context %d: long rows will finish with 'context'",
                     self.max_cache_length, self.max_context)
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_attention_bytes = int(prefill_attention_bytes)
        self.min_cache_length = int(min_cache_length)
        self.min_extend_length = int(min_extend_length)
        self.min_shared_prefix = int(min_shared_prefix)
        if min_decode_batch is None:
            low_precision = jnp.dtype(self.config.compute_dtype).itemsize < 4
            min_decode_batch = 2 if low_precision and jax.default_backend() == "cpu" else 1
        if int(min_decode_batch) < 1:
            raise ValueError(f"min_decode_batch must be >= 1, got {min_decode_batch}")
        self.min_decode_batch = int(min_decode_batch)
        self.eos_ids = tuple(int(i) for i in self.config.eos_token_ids)
        # A fresh cache's first chunk attends causally within itself: a fused kernel's case.
        self._fused_prefill = fused_attention.takes(fused_attention.resolve(self.config.attention), False, False,
                                                    self.config.attn_logit_softcap, self.config.compute_dtype,
                                                    right_padded=False)
        self._graphdef, _ = nnx.split(model)
        self._token_bytes = None
        self._stop_tables: dict = {}
        self._programs: set = set()
        # Sharding of batch-major arrays.
        if mesh is not None:
            self._dp, sh = data_parallel(mesh, rules), cache_shardings(mesh, rules, self.config.num_kv_heads)
            self._row_sharding, self._row2_sharding, self._kv_sharding, self._scalar_sharding = sh
        else:
            self._dp, sh = 1, None
        self._shared = p = _shared_programs(self._graphdef, mesh, sh)  # held: see _LIVE_PROGRAMS
        self._extend_jit, self._decode_jit, self._take_rows_jit = p.extend, p.decode, p.take_rows
        self._resize_jit, self._clear_jit, self._write_rows_jit = p.resize, p.clear, p.write_rows
        self._compact_jit, self._unstack_jit, self._segment_jit = p.compact, p.unstack, p.segment
        self.set_params(model)

    # ------------------------------------------------------------------ parameters
    def set_params(self, model: Transformer, version: Optional[int] = None) -> None:
        """Take (new) parameters from `model` (same architecture); casts matmul weights once.
        With a mesh they are placed with the sampler's own shardings (by its rules table),
        device to device, wherever the trainer kept them. `version`: the policy version they are
        (default: one more than the last); every sampled token records the version that sampled
        it (`Generation.versions`). Safe to call from another thread while this one samples: a
        call in flight finishes on the weights it started with (one prefill chunk or one decode
        call), the next takes the new ones."""
        if model.config != self.config:
            raise ValueError("set_params: the model's config differs from the sampler's")
        _, state = nnx.split(model)
        if self.mesh is not None:
            state = jax.device_put(state, state_shardings(state, self.mesh, self.rules))
        dtype = jnp.dtype(self.config.compute_dtype)
        if dtype != jnp.float32:
            def cast(path, x):
                return x.astype(dtype) if is_matmul_weight(path) else x
            state = jax.tree_util.tree_map_with_path(
                lambda p, v: v.replace(cast(p, v.get_value())) if isinstance(v, nnx.Variable) else cast(p, v),
                state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        # The cached layers run unrolled (see `Transformer.extend`): keep one parameter dict per
        # layer, and in place of the stacked layer weights keep empty placeholders (no copy twice).
        layer_params = self._unstack_jit(state)  # one compiled program for every update
        state = jax.tree.map(lambda x: x, state)
        state["layers"] = jax.tree.map(lambda x: jnp.zeros((0,), x.dtype), state["layers"])
        previous = getattr(self, "_weights", None)
        version = (0 if previous is None else previous.version + 1) if version is None else int(version)
        # One assignment: a sampling thread reads all of it or none of it.
        self._weights = _Weights(state, layer_params, model.unembedding().astype(dtype), version)

    @property
    def version(self) -> int:
        """The policy version of the current parameters (`set_params`)."""
        return self._weights.version

    @property
    def _params(self):
        return self._weights.params

    @property
    def _layer_params(self):
        return self._weights.layers

    # ------------------------------------------------------------------ bookkeeping
    @property
    def num_compiled(self) -> int:
        """Number of distinct programs compiled so far (all functions)."""
        return len(self._programs)

    def _note(self, kind: str, program) -> None:
        if (kind, program) not in self._programs:
            self._programs.add((kind, program))
            log.debug("sampler: compiling %s program #%d: %s", kind, len(self._programs), program)

    def _put_rows(self, x: np.ndarray):
        """Host batch-major array -> device, sharded over the batch axes when there is a mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, self._row_sharding if x.ndim == 1 else NamedSharding(
            self.mesh, PartitionSpec(self._row_sharding.spec[0], *([None] * (x.ndim - 1)))))

    def _put_scalar(self, x: int):
        """An int32 scalar on the device(s), placed as the cache's index is."""
        x = np.int32(x)
        return jnp.asarray(x) if self.mesh is None else jax.device_put(x, self._scalar_sharding)

    def batch_bucket(self, n: int) -> int:
        """The batch bucket of `n` rows: programs are compiled per bucket, padding rows fill it."""
        return bucket(n, 1, self._dp)

    def _empty_cache(self, batch: int, length: int) -> KVCache:
        cache = KVCache.init(self.config, batch, length)
        if self.mesh is not None:
            cache = KVCache(jax.device_put(cache.k, self._kv_sharding), jax.device_put(cache.v, self._kv_sharding),
                            jax.device_put(cache.slot_pos, self._row2_sharding),
                            jax.device_put(cache.index, self._scalar_sharding))
        return cache

    # ------------------------------------------------------------------ capacity
    def _ensure_capacity(self, state: SamplerState, needed_slots: int) -> tuple[SamplerState, int]:
        """Make room for `needed_slots` more cache slots; returns (state, slots available).

        Grows the cache to the next bucket (a copy), or, when squeezing out the empty slots
        left by padding saves at least a bucket (or the cache is at `max_cache_length`),
        compacts it. At the cap, fewer slots than asked may be available.
        """
        length, index = state.cache_length, state.index
        if needed_slots <= length - index:
            return state, needed_slots
        filled = int(state.slots_held().max(initial=0))
        grown = bucket(index + needed_slots, self.min_cache_length)
        compacted = bucket(filled + needed_slots, self.min_cache_length)
        cache = state.cache
        if grown <= self.max_cache_length and grown <= compacted:
            self._note("resize", (state.batch_bucket, length, grown))
            cache, length = self._resize_jit(grown, cache), grown
        else:
            target = min(max(compacted, length), self.max_cache_length)
            self._note("compact", (state.batch_bucket, length, target))
            cache, length, index = self._compact_jit(target, cache), target, filled
            log.debug("sampler: compacted the cache to %d filled of %d slots", filled, target)
            # Each row's slots now end at `filled`: the ones below them are empty.
            state = dataclasses.replace(state, free_below=filled - state.slots_held())
        state = dataclasses.replace(state, cache=cache, index=index)
        return state, max(0, min(needed_slots, length - index))

    # ------------------------------------------------------------------ public API
    def prefill(self, prompts: Sequence[Sequence[int]], *, cache_length: Optional[int] = None) -> SamplerState:
        """Start rows from prompts (token-id sequences of different lengths, each non-empty).

        `cache_length` reserves slots up front (e.g. prompt + expected generation), avoiding a
        later grow; default: the bucket of the longest prompt. Memory: see the module docstring.
        """
        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        if not prompts:
            raise ValueError("prefill: no prompts")
        for i, p in enumerate(prompts):
            if p.size == 0:
                raise ValueError(f"prefill: prompt {i} is empty (a row needs at least one token, e.g. BOS)")
            self._check_ids(p, f"prefill: prompt {i}")
            if p.size > self.max_context:
                raise ContextOverflowError(
                    f"prefill: prompt {i} has {p.size} tokens, more than the context limit {self.max_context}")
        slots = max(p.size for p in prompts) - 1
        length = bucket(max(slots, 1, int(cache_length or 0)), self.min_cache_length)
        if length > self.max_cache_length:
            raise ContextOverflowError(
                f"prefill: the longest prompt needs {slots} cache slots; max_cache_length is {self.max_cache_length}")
        # The segment leaves every prompt at least its last token: that one is pending.
        shared = min(common_prefix_length(prompts), min(p.size for p in prompts) - 1)
        if len(prompts) > 1 and self.min_shared_prefix and shared >= self.min_shared_prefix:
            # Compute the common prefix once (one row) and hold it once; each row then computes
            # and holds only its own rest: same values as prefilling every row, a fraction of the work.
            segment = self._prefill_rows([prompts[0][:shared + 1]], bucket(shared, self.min_extend_length))
            return self._rows_on_segment(self._segment_jit(segment.cache, 0, segment.index), prompts[0][:shared],
                                         prompts, cache_length=cache_length)
        return self._prefill_rows(prompts, length)

    def _rows_on_segment(self, shared: SharedKV, shared_ids: np.ndarray, prompts: list,
                         cache_length: Optional[int] = None) -> SamplerState:
        """Rows for `prompts` (each longer than `shared_ids`, which it starts with) continuing the
        segment `shared`: only each prompt's rest is computed and held in the rows."""
        n, P = len(prompts), len(shared_ids)
        slots = max(p.size for p in prompts) - P - 1
        length = bucket(max(slots, 1, int(cache_length or 0) - P), self.min_cache_length)
        if length > self.max_cache_length:
            raise ContextOverflowError(
                f"prefill: the longest prompt needs {slots} cache slots; max_cache_length is {self.max_cache_length}")
        batch = self.batch_bucket(n)
        last = np.zeros(batch, np.int32)
        last[:n] = [p[-1] for p in prompts]
        cache = self._empty_cache(batch, length)._replace(row_shared=self._put_rows(np.ones(batch, bool)))
        state = SamplerState(cache, self._put_rows(last), np.asarray([p.size for p in prompts], np.int64), 0,
                             last[:n].astype(np.int64), shared=shared, shared_ids=np.asarray(shared_ids, np.int64),
                             row_shared=np.ones(n, bool))
        return self._feed(state, [p[P:-1] for p in prompts], start_positions=[P] * n)

    def _prefill_rows(self, prompts: list, cache_length: int) -> SamplerState:
        n = len(prompts)
        batch = self.batch_bucket(n)
        last = np.zeros(batch, np.int32)
        last[:n] = [p[-1] for p in prompts]
        state = SamplerState(self._empty_cache(batch, cache_length), self._put_rows(last),
                             np.asarray([p.size for p in prompts], np.int64), 0, last[:n].astype(np.int64))
        return self._feed(state, [p[:-1] for p in prompts], start_positions=[0] * n)

    def append(self, state: SamplerState, token_lists: Sequence[Sequence[int]]) -> SamplerState:
        """Append tokens (e.g. a tool response) to each row; an empty list leaves a row as is.

        Costs one `extend` over the new tokens only (chunked and bucketed). Raises
        `ContextOverflowError` (before any computation) if a row would exceed the context.
        """
        if len(token_lists) != state.num_rows:
            raise ValueError(f"append: got {len(token_lists)} token lists for {state.num_rows} rows")
        lists = [np.asarray(t, np.int64).reshape(-1) for t in token_lists]
        for i, t in enumerate(lists):
            self._check_ids(t, f"append: row {i}")
            if state.lengths[i] + t.size > self.max_context:
                raise ContextOverflowError(
                    f"append: row {i} would reach {state.lengths[i] + t.size} tokens, more than the "
                    f"context limit {self.max_context}")
        if not any(t.size for t in lists):
            return state
        active = np.asarray([i for i, t in enumerate(lists) if t.size], np.int64)
        if self.batch_bucket(active.size) * 2 <= state.batch_bucket:
            # A few rows (e.g. one episode back from its tool): compute those rows only.
            done = self._append_rows(state, active, lists)
            if done is not None:
                return done
        return self._append_all(state, lists)

    def _append_rows(self, state: SamplerState, rows: np.ndarray, lists: list) -> Optional[SamplerState]:
        """Append to `rows` only: copy them out (`fork`), extend that small batch, and write their
        new slots back: into slots those rows have free below the index when they have enough
        (the others are not widened), else at the index. None when the cache cannot make room
        for the padded widths."""
        total = max(lists[i].size for i in rows)
        batch = self.batch_bucket(rows.size)
        rows_lists = [lists[i] for i in rows]
        need = sum(self._feed_plan(state, total, batch)[1])  # what `_feed` will write into the copy
        free = int(state.free_slots()[rows].min())
        if need < free:  # (at >= 1: an extend at slot 0 would take the cache for an empty one)
            # The copy writes at `at` too, into the same free slots of its own rows: it keeps the
            # cache's length (no growth, no new program shapes), and the slots go back where they were.
            at = free - need
            small = self.fork(state, rows)
            small = dataclasses.replace(small, cache=small.cache._replace(index=self._put_scalar(at)), index=at)
            if sum(self._feed_plan(small, total)[1]) == need:
                small = self._append_all(small, rows_lists)
                if small.index - at == need:
                    clear = np.zeros(state.batch_bucket, bool)
                    return self._write_rows(state, small, rows, need, src_at=at, clear=clear, kind="append-rows",
                                            at=at)
        for _ in range(2):  # making room may change the plan (its chunks depend on the cache length)
            state, available = self._ensure_capacity(state, need)
            if available < need:
                return None
            again = sum(self._feed_plan(state, total, batch)[1])
            if again <= need:
                break
            need = again
        else:
            return None
        small = self._append_all(self.fork(state, rows), rows_lists)
        clear = np.zeros(state.batch_bucket, bool)
        return self._write_rows(state, small, rows, small.index - state.index, src_at=state.index, clear=clear,
                                kind="append-rows")

    def _append_all(self, state: SamplerState, lists: list) -> SamplerState:
        # Feed [pending, t_0 .. t_{n-2}]; t_{n-1} becomes the new pending token.
        last = state.last_host
        feeds, new_last = [], np.zeros(state.batch_bucket, np.int32)
        new_last[:state.num_rows] = last
        for i, t in enumerate(lists):
            if t.size:
                feeds.append(np.concatenate([[last[i]], t[:-1]]))
                new_last[i] = t[-1]
            else:
                feeds.append(t)
        starts = [int(state.lengths[i]) - 1 for i in range(state.num_rows)]
        lengths = state.lengths + np.asarray([t.size for t in lists])
        # Lengths change after the feed: a compaction inside it counts the slots already filled.
        state = self._feed(dataclasses.replace(state, last_token=self._put_rows(new_last),
                                               last_host=new_last[:state.num_rows].astype(np.int64)),
                           feeds, start_positions=starts)
        return dataclasses.replace(state, lengths=lengths)

    def fork(self, state: SamplerState, rows: Sequence[int]) -> SamplerState:
        """A state whose row j is a copy of `state` row `rows[j]` (repeats fork; omissions drop).

        E.g. `fork(state, [0] * 8)` makes 8 branches of row 0; `fork(state, still_running)`
        drops finished episodes. The KV cache rows are copied on device, nothing is recomputed;
        give the branches different keys in `generate` (a single key already does).
        """
        rows = self._check_rows(state, rows, "fork")
        if rows.size == 0:
            raise ValueError("fork: no rows")
        cache, last = self._gather_rows(state, rows, self.batch_bucket(rows.size), "fork")
        return dataclasses.replace(state, cache=cache, last_token=last, lengths=state.lengths[rows].copy(),
                                   last_host=state.last_host[rows].copy(),
                                   row_shared=None if state.row_shared is None else state.row_shared[rows].copy(),
                                   free_below=None if state.free_below is None else state.free_below[rows].copy())

    def _widen(self, state: SamplerState, batch: int) -> SamplerState:
        """`state` with at least `batch` cache rows; the added rows are padding (copies of row 0)."""
        if state.batch_bucket >= batch:
            return state
        cache, last = self._gather_rows(state, np.arange(state.batch_bucket), batch, "widen")
        return dataclasses.replace(state, cache=cache, last_token=last)

    def _gather_rows(self, state: SamplerState, rows: np.ndarray, batch: int, kind: str):
        """(cache, last_token) of `batch` rows: row j is `state` row `rows[j]`, padding rows copy row 0."""
        gather = np.zeros(batch, np.int32)
        gather[:rows.size] = rows
        self._note(kind, (state.batch_bucket, batch, state.cache_length))
        return self._take_rows_jit(self._put_rows(gather), state.cache, state.last_token)

    def generate(self, state: SamplerState, key, *, max_new_tokens: Union[int, Sequence[int]],
                 params: SamplingParams = SamplingParams(), stop: Sequence[stop_lib.Stop] = (),
                 stop_token_ids: Optional[Sequence[int]] = None,
                 running: Optional[Sequence[Optional[Generation]]] = None, max_steps: Optional[int] = None,
                 return_on_finish: bool = False) -> tuple[SamplerState, list]:
        """Generate up to `max_new_tokens` per row, in one jitted loop; returns (state, generations).

        Args:
          key: a PRNG key (row b uses `fold_in(key, b)`) or one key per row ([num_rows] keys).
          max_new_tokens: an int, or one per row (0 leaves a row untouched this call).
          params: `SamplingParams` (greedy / temperature / top-k / top-p / entropies).
          stop: stop strings (needs a tokenizer); a row stops when its generated text contains one.
            Or one `stop.TwoPartStop` alone (e.g. the end of the first complete code block).
          stop_token_ids: ids that end a row (reason `eos`); default: the model's EOS ids.
          max_steps: return after at most this many decode steps; rows not finished by then come
            back with finish_reason `running` (continue them by passing them in `running`).
          return_on_finish: also return as soon as any row finishes (continuous batching: its
            row can take other work while the others go on).
          running: per row, None or a `running` Generation from an earlier call to continue:
            its tokens count against `max_new_tokens`, its stop strings may straddle the calls,
            and its t-th token uses `fold_in(row_key, t)` as if generated in one call. Give
            such a row the same key in every call.

        Returns the new state (every sampled token, the last one pending) and one `Generation`
        per row (a continued row's holds all its tokens so far). Without `max_steps` and
        `return_on_finish`, the loop runs until every row is done.
        """
        n = state.num_rows
        max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (n,)).copy()
        if max_new.min(initial=0) < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if running is not None and len(running) != n:
            raise ValueError(f"generate: got {len(running)} running generations for {n} rows")
        if max_steps is not None and int(max_steps) < 1:
            raise ValueError(f"generate: max_steps must be >= 1, got {max_steps}")
        running = [g if g is not None and g.finish_reason == "running" else None for g in (running or [None] * n)]
        n0 = np.asarray([0 if g is None else len(g.tokens) for g in running], np.int64)
        auto0 = np.asarray([0 if g is None else g.stop_state for g in running], np.int64)
        stop = tuple(stop)
        if any(not isinstance(s, stop_lib.TwoPartStop) and (not isinstance(s, str) or not s) for s in stop):
            raise ValueError(f"generate: stop strings must be non-empty str (or a stop.TwoPartStop), got {stop!r}")
        if stop and self.tokenizer is None:
            raise ValueError("generate: stop strings need a tokenizer (Sampler(model, tokenizer))")
        stop_ids = self.eos_ids if stop_token_ids is None else tuple(int(i) for i in stop_token_ids)
        self._check_ids(np.asarray(stop_ids, np.int64), "generate: stop_token_ids")
        # Rows at the context limit cannot sample; the others are capped by it (reason `context`).
        room = self.max_context - state.lengths
        remaining = np.maximum(max_new - n0, 0)
        wanted = int(remaining.max(initial=1))
        limit = wanted if max_steps is None else min(int(max_steps), wanted)
        needed = int(np.minimum(remaining, np.maximum(room, 0)).max(initial=0))
        state, _ = self._ensure_capacity(state, max(min(needed, limit), 1))
        state = self._widen(state, self.batch_bucket(self.min_decode_batch))
        B = state.batch_bucket
        max_new_b = np.zeros(B, np.int32)
        max_new_b[:n] = max_new
        at_limit = (room <= 0) & (remaining > 0)
        max_new_b[:n][at_limit] = n0[at_limit]
        length_b = np.ones(B, np.int32)
        length_b[:n] = state.lengths
        n0_b, auto0_b = np.zeros(B, np.int32), np.zeros(B, np.int32)
        n0_b[:n], auto0_b[:n] = n0, auto0
        table, states = self._stop_table(stop)
        program = DecodeProgram(
            batch=B, cache_length=state.cache_length, max_new=bucket(max(limit, 1), 16),
            greedy=params.greedy, top_k=int(params.top_k), top_p=params.top_p < 1.0,
            with_entropy=params.with_entropy, stop_ids=tuple(sorted(set(stop_ids))), stop_states=states,
            max_context=self.max_context, shared=state.shared_slots)
        self._note("decode", program)
        keys = self._row_keys(key, n, B)
        weights = self._weights  # the whole call samples with one version
        cache, last, out_tok, out_lp, out_ent, n_gen, auto, reason = self._decode_jit(
            weights.params, weights.layers, weights.unembed, state.cache, state.last_token, self._put_rows(length_b),
            self._put_rows(max_new_b), keys, self._put_rows(n0_b), self._put_rows(auto0_b), jnp.int32(limit),
            jnp.bool_(return_on_finish), jnp.float32(params.temperature), jnp.float32(params.top_p),
            table, state.shared, program=program)
        out_tok, out_lp, out_ent, n_gen, auto, reason = jax.device_get((out_tok, out_lp, out_ent, n_gen, auto, reason))
        new = np.asarray(n_gen[:n], np.int64) - n0  # tokens generated in this call
        reason = np.asarray(reason[:n]).copy()
        reason[at_limit] = CONTEXT
        last_host = state.last_host.copy()
        moved = new > 0
        last_host[moved] = np.asarray(out_tok)[:n][moved, new[moved] - 1]
        new_state = dataclasses.replace(state, cache=cache, last_token=last, lengths=state.lengths + new,
                                        index=state.index + int(new.max(initial=0)), last_host=last_host)
        gens = []
        for b in range(n):
            k, before = int(new[b]), running[b]
            tokens, logprobs = np.asarray(out_tok[b, :k], np.int32), np.asarray(out_lp[b, :k])
            entropies = np.asarray(out_ent[b, :k]) if params.with_entropy else None
            versions = np.full(k, weights.version, np.int32)
            if before is not None:
                tokens, logprobs = np.concatenate([before.tokens, tokens]), np.concatenate([before.logprobs, logprobs])
                versions = np.concatenate([before.versions, versions])
                if entropies is not None:
                    entropies = np.concatenate([before.entropies, entropies])
            gen = Generation(tokens=tokens, logprobs=logprobs, finish_reason=FINISH_REASONS[int(reason[b])],
                             entropies=entropies, stop_state=int(auto[b]), versions=versions)
            if self.tokenizer is not None and gen.finish_reason != "running":
                self._set_text(gen, stop)
            gens.append(gen)
        return new_state, gens

    def clear(self, state: SamplerState, rows: Sequence[int]) -> SamplerState:
        """Empty `rows` of `state` (their slots are freed for `compact`; the rows stay, holding
        nothing but a pending token) so that `insert` can start new prompts in them."""
        rows = self._check_rows(state, rows, "clear")
        mask = np.zeros(state.batch_bucket, bool)
        mask[rows] = True
        # Padding rows (copies of row 0 from a fork or a widening) are emptied too: once real rows
        # can shrink, a padding row must never hold more slots than they do (see `compact`).
        mask[state.num_rows:] = True
        self._note("clear", (state.batch_bucket, state.cache_length))
        cache = self._clear_jit(self._put_rows(mask), state.cache)
        lengths = state.lengths.copy()
        lengths[rows] = 1
        row_shared = None if state.row_shared is None else state.row_shared.copy()
        if row_shared is not None:
            row_shared[rows] = False  # they hold nothing (until `insert` says what they continue)
        free = state.free_slots().copy()
        free[rows] = state.index
        return dataclasses.replace(state, cache=cache, lengths=lengths, row_shared=row_shared, free_below=free)

    def insert(self, state: SamplerState, rows: Sequence[int], prompts: Sequence[Sequence[int]],
               prefix: Optional[tuple] = None) -> SamplerState:
        """Start `prompts` in `rows` of a running `state` (what the rows held is dropped); the
        other rows are untouched. Only the new prompts are computed (a `prefill` of their own,
        shared prefix once), then their cache rows are written into the target rows' own slots
        just before the write index: those rows' old content is dropped, so the slots are free,
        and an insert takes no new slots unless the prompt is longer than the running state
        (then the index moves up to its width). Without this, every insert would widen every
        row by the new prompt, and decode would attend over those empty slots.
        Consumes `state`; raises `ContextOverflowError` (state intact) when the prompt does not
        fit in the cache.

        `prefix`: (ids, one-row state from `prefill([ids])`), e.g. a system prompt every episode
        starts with, computed once and kept: prompts that start with `ids` (and go beyond them)
        compute only their rest. The prefix state is not consumed."""
        rows = self._check_rows(state, rows, "insert")
        if len(prompts) != rows.size:
            raise ValueError(f"insert: got {len(prompts)} prompts for {rows.size} rows")
        if len(set(rows.tolist())) != rows.size:
            raise ValueError(f"insert: rows repeat: {rows.tolist()}")
        longest = max((len(p) for p in prompts), default=0)
        if not longest or longest > self.max_context:
            self.prefill(prompts)  # raises the error that names the prompt at fault
        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        # Prompts that start with the state's shared segment (and go beyond it) continue it.
        P = state.shared_length
        on = np.asarray([P > 0 and p.size > P and np.array_equal(p[:P], state.shared_ids) for p in prompts])
        if on.any() and not on.all():  # those on the segment, then the others
            # Both must fit before the first is written (a write consumes `state`).
            for group, held in ((on, P), (~on, 0)):
                width = bucket(max(max(p.size for p, g in zip(prompts, group) if g) - 1 - held, 1),
                               self.min_extend_length)
                if width > self.max_cache_length:
                    raise ContextOverflowError(f"insert: {width} cache slots needed, at most {self.max_cache_length} "
                                               f"in the cache (max_cache_length)")
            state = self.insert(state, rows[on], [p for p, o in zip(prompts, on) if o])
            return self.insert(state, rows[~on], [p for p, o in zip(prompts, on) if not o], prefix)
        on_segment = bool(on.all())
        # The new rows take slots [at, at + width) of their own rows, width = bucket(longest - 1),
        # ending at the write index where it is that far along: check before computing anything.
        width = bucket(max(longest - 1 - (P if on_segment else 0), 1), self.min_extend_length)
        extra = max(0, width - state.index)  # slots to add past the index
        for _ in range(2):  # a compaction lowers the index, so more are needed: then it grows
            if extra <= state.cache_length - state.index:
                break
            state, _ = self._ensure_capacity(state, extra)
            extra = max(0, width - state.index)
        if extra > state.cache_length - state.index:
            raise ContextOverflowError(f"insert: {width} cache slots needed, {state.cache_length} in the "
                                       f"cache (max_cache_length {self.max_cache_length})")
        at = state.index + extra - width
        fresh = None
        if on_segment:
            fresh = self._rows_on_segment(state.shared, state.shared_ids, prompts)
        elif prefix is not None:
            ids, prefix_state = prefix
            n = len(ids)
            if all(len(p) > n and list(p[:n]) == list(ids) for p in prompts):
                fresh = self.append(self.fork(prefix_state, [0] * len(prompts)), [p[n:] for p in prompts])
        if fresh is None:  # rows of their own: a segment of theirs could not be written into `state`
            fresh = self._prefill_rows(prompts, bucket(max(longest - 1, 1), self.min_cache_length))
        if fresh.cache_length != width:  # squeeze its filled slots into exactly `width` (at the end)
            self._note("compact", (fresh.batch_bucket, fresh.cache_length, width))
            fresh = dataclasses.replace(fresh, cache=self._compact_jit(width, fresh.cache))
        # The target rows' old slots are emptied, and so are the padding rows' (see `clear`).
        clear = np.arange(state.batch_bucket) >= state.num_rows
        clear[rows] = True
        return self._write_rows(state, fresh, rows, width, src_at=0, clear=clear, kind="insert", at=at)

    def _write_rows(self, state: SamplerState, src: SamplerState, rows: np.ndarray, width: int, src_at: int,
                    clear: np.ndarray, kind: str, at: Optional[int] = None) -> SamplerState:
        """`state` whose `rows` are `src`'s rows 0.. (slots [src_at, src_at + width) written at
        `at`, default `state.index`; the index becomes at least at + width); see `_write_rows_impl`."""
        at = state.index if at is None else int(at)
        if src.shared is not None and src.shared is not state.shared:
            raise ValueError(f"{kind}: the rows written continue a shared segment the state does not hold")
        target = np.full(src.batch_bucket, state.batch_bucket, np.int32)  # padding rows: dropped
        target[:rows.size] = rows
        self._note(kind, (state.batch_bucket, state.cache_length, src.batch_bucket, src.cache_length, width))
        cache, last = self._write_rows_jit(width, state.cache, state.last_token, src.cache, src.last_token,
                                           self._put_rows(target), self._put_rows(clear), jnp.int32(at),
                                           jnp.int32(src_at))
        lengths, last_host = state.lengths.copy(), state.last_host.copy()
        lengths[rows], last_host[rows] = src.lengths[:rows.size], src.last_host[:rows.size]
        row_shared = None if state.row_shared is None else state.row_shared.copy()
        if row_shared is not None:
            row_shared[rows] = False if src.row_shared is None else src.row_shared[:rows.size]
        free = state.free_slots().copy()  # the rows' slots below `at` stay as they were (emptied: free)
        free[rows] = np.where(clear[rows], at, np.minimum(free[rows], at))
        return dataclasses.replace(state, cache=cache, last_token=last, lengths=lengths,
                                   index=max(state.index, at + width), last_host=last_host, row_shared=row_shared,
                                   free_below=free)

    def _check_rows(self, state: SamplerState, rows, what: str) -> np.ndarray:
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= state.num_rows):
            raise IndexError(f"{what}: rows must be in [0, {state.num_rows}), got {rows.tolist()}")
        return rows

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """Text of token ids as the stop-string detector sees it (special tokens dropped)."""
        table = self.token_bytes()
        return b"".join(table[int(t)] for t in token_ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ internals
    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"{what}: token id {int(bad)} is outside the vocabulary [0, {self.config.vocab_size})")

    def _row_keys(self, key, n: int, B: int):
        """[B, 2] uint32 row keys on the device (row b: `fold_in(key, b)`, or the given per-row
        key; padding rows get keys too, never read), without a round trip through the host."""
        if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        shape = tuple(np.shape(key))
        if shape == (2,):
            keys = _fold_rows(jnp.asarray(key, jnp.uint32), B)
        elif shape == (n, 2):
            keys = jnp.pad(jnp.asarray(key, jnp.uint32), ((0, B - n), (0, 0)))
        else:
            raise ValueError(f"generate: key must be one PRNG key or {n} keys (one per row), got shape {shape}")
        return self._put_rows(keys)

    def token_bytes(self) -> list:
        """The bytes of every token id as the stop-string detector sees them (`stop.token_bytes_table`,
        built once on first use)."""
        if self._token_bytes is None:
            self._token_bytes = stop_lib.token_bytes_table(self.tokenizer, self.config.vocab_size)
        return self._token_bytes

    def _stop_table(self, stop: tuple):
        if not stop:
            return jnp.zeros((1, 1), jnp.int32), 0
        key = tuple(sorted(set(stop), key=repr))
        if key not in self._stop_tables:
            states = bucket(stop_lib.num_states(key), 16)
            table = stop_lib.stop_transition_table(key, self.token_bytes(), states)
            self._stop_tables[key] = (jnp.asarray(table), states)
        return self._stop_tables[key]

    def _set_text(self, gen: Generation, stop: tuple) -> None:
        table = self.token_bytes()
        data = b"".join(table[int(t)] for t in gen.tokens)
        text = data.decode("utf-8", errors="replace")
        if gen.finish_reason == "stop":
            end, which = stop_lib.first_stop(text, stop)
            if end is None:  # cannot happen for valid UTF-8 stop strings; keep everything
                log.warning("stop string detected on device but not found in the text %r", text[-80:])
            else:
                gen.stop_string, gen.text_after_stop, text = which, text[end:], text[:end]
        gen.text = text

    def _chunks(self, total: int, batch: int, slots: int, fresh: bool = False) -> tuple[list, list]:
        """How `_feed` cuts `total` new tokens: (chunk sizes, their bucketed widths in slots).
        `fresh` (an empty cache, fused prefill): the first chunk builds no [B, N, T, S] logits,
        so only `prefill_chunk` bounds it."""
        chunk = extend_chunk(self.prefill_chunk, self.prefill_attention_bytes, self.min_extend_length, batch,
                             self.config.num_heads, slots)
        first = min(total, self.prefill_chunk if fresh else chunk)
        sizes = [first] + [min(chunk, total - lo) for lo in range(first, total, chunk)]
        return sizes, [bucket(c, self.min_extend_length) for c in sizes]

    def _feed_plan(self, state: SamplerState, total: int, batch: Optional[int] = None) -> tuple[list, list, bool]:
        """(chunk sizes, their widths in slots, fused first chunk) `_feed` uses for `total` new tokens
        per row of `state` (or of a `batch`-row copy of it)."""
        fresh = state.index == 0 and self._fused_prefill and state.shared is None
        slots = max(state.cache_length, bucket(state.index + total, self.min_cache_length)) + state.shared_slots
        return (*self._chunks(total, batch or state.batch_bucket, slots, fresh=fresh), fresh)

    def _feed(self, state: SamplerState, feeds: Sequence[np.ndarray], start_positions) -> SamplerState:
        """Write `feeds[b]` (at positions start_positions[b], ...) into the cache, right-aligned
        across rows, in chunks of at most `prefill_chunk` tokens (each bucketed)."""
        total = max(f.size for f in feeds)
        if total == 0:
            return state
        B = state.batch_bucket
        sizes, widths, fresh = self._feed_plan(state, total)
        state, available = self._ensure_capacity(state, sum(widths))
        if available < sum(widths):  # at the cache cap: no bucket padding
            state, available = self._ensure_capacity(state, total)
            widths = sizes
            if available < total:
                raise ContextOverflowError(
                    f"{total} new cache slots needed, but the cache is capped at {self.max_cache_length} slots")
        ids = np.zeros((B, total), np.int32)
        pos = np.full((B, total), -1, np.int32)
        for b, (f, start) in enumerate(zip(feeds, start_positions)):
            if f.size:
                ids[b, total - f.size:] = f
                pos[b, total - f.size:] = np.arange(start, start + f.size)
        cache, index, lo = state.cache, state.index, 0
        weights = self._weights  # one version for the whole feed
        for chunk, T in zip(sizes, widths):
            ids_c = np.zeros((B, T), np.int32)
            pos_c = np.full((B, T), -1, np.int32)
            # Left-pad the chunk: padding slots come before the real tokens.
            ids_c[:, T - chunk:] = ids[:, lo:lo + chunk]
            pos_c[:, T - chunk:] = pos[:, lo:lo + chunk]
            program = ExtendProgram(B, T, state.cache_length, fresh=index == 0 and fresh,
                                    shared=state.shared_slots)
            self._note("extend", program)
            cache = self._extend_jit(weights.params, weights.layers, cache, self._put_rows(ids_c),
                                     self._put_rows(pos_c), state.shared, program=program)
            index += T
            lo += chunk
        return dataclasses.replace(state, cache=cache, index=index)


@functools.partial(jax.jit, static_argnums=1)
def _fold_rows(key, rows: int):
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(rows))


def _identity(x):
    return x


def common_prefix_length(prompts: Sequence[np.ndarray]) -> int:
    """Length of the longest token prefix shared by all prompts."""
    shortest = min(p.size for p in prompts)
    same = np.ones(shortest, bool)
    for p in prompts[1:]:
        same &= p[:shortest] == prompts[0][:shortest]
    return int(shortest if same.all() else np.argmin(same))
