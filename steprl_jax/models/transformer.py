"""The decoder family (Llama/SmolLM, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3) as one Flax NNX module.

Layer parameters are stacked on a leading `layers` axis. Full-sequence passes (training,
scoring) run the layers under `jax.lax.scan`: one compiled layer instead of `num_layers`
copies, which keeps compile times short on CPU and TPU alike; per-layer differences
(Gemma's local vs global layers, their rope bases) are scanned data, not Python branches.
Cached passes (`extend`: prefill, continue, decode) run the layers unrolled over a per-layer
KV cache, so that each layer reads and updates its cache buffer in place (see `KVCache`).

Activations stay float32; every matmul goes through `projection` (weights) or
`models.attention`, which cast their inputs to the compute dtype and accumulate in float32
(bf16-in/f32-out is the fast path on CPU and TPU; float32 is exact for parity tests).

Shapes: B batch, T query length, S key length (cache slots), D hidden, N query
heads, K kv heads, G = N // K, H head dim, F mlp width, V vocab, L layers.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from steprl_jax.models.config import ModelConfig, RopeConfig
from steprl_jax.models import fused_attention
from steprl_jax.models.attention import MASKED, attention, attention_with_shared, causal_attention, tree_mask
from steprl_jax.ops.tree_attention import TreeRows
from steprl_jax.ops.matmul import projection
from steprl_jax.models import lora

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, w, eps: float, plus_one: bool):
    return _rms_norm_fwd(x, w, eps, plus_one)[0]


def _rms_norm_fwd(x, w, eps, plus_one):
    x_hat = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x_hat * x_hat, axis=-1, keepdims=True) + eps)
    x_hat = x_hat * inv_rms
    return x_hat * (1.0 + w if plus_one else w), (x, inv_rms, w)


def _rms_norm_bwd(eps, plus_one, res, g):
    """The weight's gradient sums g * x_hat over every token: written as a matrix-vector product,
    because XLA:CPU's reduction over the leading axis (what autodiff emits) ran ~8x slower."""
    x, inv_rms, w = res
    d = x.shape[-1]
    x_hat_nd = (x.astype(jnp.float32) * inv_rms).reshape(-1, d)
    g_nd = g.astype(jnp.float32).reshape(-1, d)
    d_w = jnp.dot(jnp.ones((g_nd.shape[0],), jnp.float32), g_nd * x_hat_nd)
    g_w = g_nd * (1.0 + w if plus_one else w)
    d_x = inv_rms.reshape(-1, 1) * (g_w - x_hat_nd * jnp.mean(g_w * x_hat_nd, axis=-1, keepdims=True))
    return d_x.reshape(x.shape).astype(x.dtype), d_w.astype(w.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions_bt, rope: RopeConfig, head_dim: int):
    """cos, sin of shape [B, T, H] (rotate-half layout, as in Hugging Face)."""
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(_inv_freq(rope, head_dim))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _apply_rope(x_btnh, cos_bth, sin_bth):
    half = x_btnh.shape[-1] // 2
    rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    return x_btnh * cos_bth[:, :, None, :] + rotated * sin_bth[:, :, None, :]


class KVCache(NamedTuple):
    """Keys and values of every layer, in slots.

    One array per layer (not one stacked array): a layer's attention then reads its cache
    buffer in place. With a stacked [L, ...] cache, XLA:CPU copies the layer's slice out of
    it before each matmul, which tripled the bytes moved per decode step.

    All rows write at the same slot `index` (so the write is one dynamic slice);
    rows that have fewer new tokens than others are left-padded with empty slots
    (`slot_pos == -1`), which attention ignores. `slot_pos[b, s]` is the rotary
    position of the token held in slot `s` of row `b`.

    With a `SharedKV` segment (a prompt prefix every row starts with, held once), `row_shared[b]`
    says whether row b continues it: its queries then also see the segment's keys, and its own
    slots hold only what follows the prefix.
    """

    k: tuple  # L arrays [B, K, S, H]: a kv head's keys contiguous, as attention reads them
    v: tuple  # L arrays [B, K, S, H]
    slot_pos: jax.Array  # [B, S] int32, -1 where empty
    index: jax.Array  # [] int32, next slot to write
    row_shared: Optional[jax.Array] = None  # [B] bool where a shared segment exists

    @classmethod
    def init(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
        dtype = dtype or jnp.dtype(config.compute_dtype)
        shape = (batch, config.num_kv_heads, length, config.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
        return cls(zeros(), zeros(), jnp.full((batch, length), -1, jnp.int32), jnp.zeros((), jnp.int32))

    @property
    def length(self) -> int:
        return self.slot_pos.shape[1]

    def take_rows(self, rows) -> "KVCache":
        """Cache rows `rows` (e.g. [0, 0, 0, 1, 1, 1] forks two sequences three ways each)."""
        rows = jnp.asarray(rows, jnp.int32)
        return KVCache(tuple(k[rows] for k in self.k), tuple(v[rows] for v in self.v),
                       self.slot_pos[rows], self.index, None if self.row_shared is None else self.row_shared[rows])

    def bytes(self) -> int:
        return 2 * sum(k.size * k.dtype.itemsize for k in self.k) + self.slot_pos.size * 4


class SharedKV(NamedTuple):
    """Keys and values of a prompt prefix that rows of a `KVCache` share, held once: attention
    reads them once per step for every row that continues them (`KVCache.row_shared`). Never
    written after it is made, so sampling programs take it without donating it."""

    k: tuple  # L arrays [K, P, H]
    v: tuple  # L arrays [K, P, H]
    pos: jax.Array  # [P] int32 rotary positions, -1 where empty

    @classmethod
    def from_row(cls, cache: KVCache, row: int = 0, slots: Optional[int] = None) -> "SharedKV":
        """The segment held by row `row` of `cache` (e.g. a one-row prefill of the prefix), its
        first `slots` slots (default: all)."""
        cut = slice(0, slots)
        return cls(tuple(k[row, :, cut] for k in cache.k), tuple(v[row, :, cut] for v in cache.v),
                   cache.slot_pos[row, cut])

    def bytes(self) -> int:
        return 2 * sum(k.size * k.dtype.itemsize for k in self.k) + self.pos.size * 4


def _param(rngs, shape, axes, init="normal", std=0.02):
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
    """All decoder layers, parameters stacked on a leading `layers` axis."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        L, D, N, K, H, F = c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        norm_init = "zeros" if c.norm_plus_one else "ones"
        self.attn_norm = _param(rngs, (L, D), ("layers", "norm"), norm_init)
        self.q = _param(rngs, (L, D, N, H), ("layers", "embed", "heads", "kv"))
        self.k = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "kv"))
        self.v = _param(rngs, (L, D, K, H), ("layers", "embed", "kv_heads", "kv"))
        self.o = _param(rngs, (L, N, H, D), ("layers", "heads", "kv", "embed"))
        if c.qkv_bias:
            self.q_bias = _param(rngs, (L, N, H), ("layers", "heads", "kv"))
            self.k_bias = _param(rngs, (L, K, H), ("layers", "kv_heads", "kv"))
            self.v_bias = _param(rngs, (L, K, H), ("layers", "kv_heads", "kv"))
        if c.qk_norm:
            self.q_norm = _param(rngs, (L, H), ("layers", "norm"), norm_init)
            self.k_norm = _param(rngs, (L, H), ("layers", "norm"), norm_init)
        if c.sandwich_norms:
            self.attn_out_norm = _param(rngs, (L, D), ("layers", "norm"), norm_init)
            self.mlp_out_norm = _param(rngs, (L, D), ("layers", "norm"), norm_init)
        self.mlp_norm = _param(rngs, (L, D), ("layers", "norm"), norm_init)
        self.gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"))
        self.up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"))
        self.down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"))

    def stacked(self) -> dict:
        """The stacked weights by name (with LoRA, the adapters too: see `layer_weights`)."""
        return {name: value.get_value() for name, value in vars(self).items() if isinstance(value, nnx.Variable)}

    def layer_weights(self, p: dict) -> dict:
        """A layer's weights as the decoder layer reads them: LoRA adapters folded in (models/lora.py)."""
        scale = getattr(self, "lora_scale", None)
        return p if scale is None else lora.merge_layer(p, scale)

    def unstacked(self) -> tuple:
        """One parameter dict per layer (slices of the stacked arrays, adapters merged)."""
        stacked = self.stacked()
        return tuple(self.layer_weights({name: w[i] for name, w in stacked.items()})
                     for i in range(len(self.attn_norm)))


class Transformer(nnx.Module):
    """Decoder-only transformer. `model(input_ids)` returns float32 logits [B, T, V]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.layers = DecoderLayers(c, rngs=rngs)
        self.final_norm = _param(rngs, (c.hidden_size,), ("norm",), "zeros" if c.norm_plus_one else "ones")
        if not c.tie_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"))

    # --------------------------------------------------------------- public API
    def __call__(self, input_ids_bt, *, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None):
        hidden = self.hidden_states(input_ids_bt, positions_bt=positions_bt,
                                    attention_mask_bt=attention_mask_bt, segment_ids_bt=segment_ids_bt)
        return self.logits_from_hidden(hidden)

    def hidden_states(self, input_ids_bt, *, positions_bt=None, attention_mask_bt=None, segment_ids_bt=None,
                      branch_ids_bt=None, branch_ends_bt=None, key_blocks_bqm=None, remat: Optional[str] = None):
        """Final-normed hidden states [B, T, D] for a full sequence (no cache).

        `attention_mask_bt` (1 = real token) marks padding; it is never inferred
        from token ids. `segment_ids_bt` separates packed sequences. Positions
        default to the count of real tokens before each token (within its segment).

        `branch_ids_bt` packs a tree of continuations of a shared prefix into a row: the
        branches (tree nodes) are numbered in depth-first preorder, and `branch_ends_bt` holds,
        for each token, one past the last number in its branch's subtree. A token sees
        (causally) the tokens of its branch and of its ancestors only: key j is visible to query
        i iff id_j <= id_i < end_j, an interval test on two [B, T] arrays. Without ends the tree
        has two levels: branch 0, the prefix, is every branch's parent (end = infinity for 0,
        g + 1 for g). Pass `positions_bt` with it (each branch continues its parent's
        positions): the row then computes exactly what one row per root-to-leaf path would.
        `key_blocks_bqm` (`models.attention.key_block_table` of this mask, from the packer)
        lets each block of queries attend over the key blocks it sees only.

        `remat` names the rematerialisation policy applied to each layer for the backward pass
        (see `remat_policy`: e.g. "nothing_saveable" keeps only each layer's input and
        recomputes the rest, "qkvo_saveable" also keeps the attention projections' outputs);
        None keeps every intermediate.
        """
        input_ids_bt = jnp.asarray(input_ids_bt)
        if input_ids_bt.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {input_ids_bt.shape}")
        B, T = input_ids_bt.shape
        valid_bt = (jnp.ones((B, T), bool) if attention_mask_bt is None
                    else jnp.asarray(attention_mask_bt).astype(bool))
        segments_bt = (jnp.zeros((B, T), jnp.int32) if segment_ids_bt is None
                       else jnp.asarray(segment_ids_bt, jnp.int32))
        if positions_bt is None:
            positions_bt = _default_positions(valid_bt, segments_bt)
        positions_bt = jnp.asarray(positions_bt, jnp.int32)
        node_bt = end_bt = None
        if branch_ids_bt is not None:
            node_bt = jnp.asarray(branch_ids_bt, jnp.int32)
            end_bt = (jnp.where(node_bt == 0, jnp.iinfo(jnp.int32).max, node_bt + 1) if branch_ends_bt is None
                      else jnp.asarray(branch_ends_bt, jnp.int32))
        x = self._embed(input_ids_bt)
        impl = fused_attention.resolve(self.config.attention)
        if fused_attention.takes(impl, node_bt is not None, segment_ids_bt is not None,
                                 self.config.attn_logit_softcap, self.config.compute_dtype):
            # A fused kernel builds the mask from these [B, T] arrays, tile by tile.
            no_tree = node_bt is None
            rows = TreeRows(valid_bt, segments_bt, jnp.zeros((B, T), jnp.int32) if no_tree else node_bt,
                            jnp.full((B, T), jnp.iinfo(jnp.int32).max) if no_tree else end_bt, positions_bt)
            x = self._run_layers_fused(x, positions_bt, rows, impl, not no_tree, remat)
        else:
            mask_bts = tree_mask(jnp, valid_bt, segments_bt, node_bt, end_bt)
            x = self._run_layers(x, positions_bt, mask_bts, positions_bt, remat, key_blocks_bqm)
        return self._final_norm(x)

    def extend(self, input_ids_bt, positions_bt, cache: KVCache, layer_params: Optional[tuple] = None,
               fresh: bool = False, shared: Optional[SharedKV] = None):
        """Append T tokens per row to `cache`, returning (hidden [B, T, D], new cache).

        `positions_bt[b, t] == -1` marks a padding slot (a row with fewer new
        tokens than the others). The caller guarantees `cache.index + T <= cache.length`.
        Prefill is `extend` on an empty cache; decoding is `extend` with T = 1.
        `fresh`: the cache is empty and each row's positions rise with its slots (a prefill's
        first chunk), so the tokens attend to each other causally: a fused kernel
        (`models.fused_attention`) takes them where there is one, not a [B, T, S] mask.

        The layers run unrolled (each layer reads its own cache buffer in place). Pass
        `layer_params` (from `self.layers.unstacked()`, made once) to avoid slicing the stacked
        weights at every call; the sampler does. `shared`: the segment the rows with
        `cache.row_shared` continue (their queries attend over it too).
        """
        input_ids_bt = jnp.asarray(input_ids_bt)
        positions_bt = jnp.asarray(positions_bt, jnp.int32)
        T = input_ids_bt.shape[1]
        q_pos = jnp.maximum(positions_bt, 0)
        # Keys: all slots after writing the new tokens; empty slots have position -1.
        slot_pos = jax.lax.dynamic_update_slice(cache.slot_pos, positions_bt, (0, cache.index))
        key_pos = slot_pos
        if shared is not None:  # the segment's keys follow the row's own, visible to the rows that continue it
            if cache.row_shared is None:
                raise ValueError("extend: a shared segment needs a cache with `row_shared`")
            key_pos = jnp.concatenate(
                [slot_pos, jnp.where(cache.row_shared[:, None], shared.pos[None, :], -1)], axis=1)
        x = self._embed(input_ids_bt)
        impl = fused_attention.resolve(self.config.attention)
        rows = None
        if fresh and shared is None and fused_attention.takes(impl, False, False, self.config.attn_logit_softcap,
                                           self.config.compute_dtype, right_padded=False):
            B, T = positions_bt.shape
            rows = TreeRows(positions_bt >= 0, jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.int32),
                            jnp.full((B, T), jnp.iinfo(jnp.int32).max), q_pos)
            mask_bts = None
        else:
            mask_bts = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= q_pos[:, :, None])
        x, cache_k, cache_v = self._run_layers_cached(x, q_pos, mask_bts, key_pos, cache,
                                                      layer_params or self.layers.unstacked(), rows, impl, shared)
        return self._final_norm(x), cache._replace(k=cache_k, v=cache_v, slot_pos=slot_pos, index=cache.index + T)

    def prefill(self, input_ids_bt, positions_bt, cache_length: int):
        cache = KVCache.init(self.config, input_ids_bt.shape[0], cache_length)
        return self.extend(input_ids_bt, positions_bt, cache)

    def decode(self, token_b, position_b, cache: KVCache):
        hidden, cache = self.extend(token_b[:, None], position_b[:, None], cache)
        return hidden[:, 0], cache

    def unembedding(self):
        """[V, D] output embedding (the input embedding when tied)."""
        return (self.embed if self.config.tie_embeddings else self.lm_head).get_value()

    def logits_from_hidden(self, hidden):
        dtype = jnp.dtype(self.config.compute_dtype)
        logits = jnp.einsum("...d,vd->...v", hidden.astype(dtype), self.unembedding().astype(dtype),
                            preferred_element_type=jnp.float32)
        return softcap(logits, self.config.final_logit_softcap)

    # ------------------------------------------------------------- internals
    def _embed(self, ids):
        x = jnp.take(self.embed.get_value(), ids, axis=0).astype(jnp.float32)
        if self.config.embed_scale:
            x = x * jnp.float32(np.sqrt(self.config.hidden_size))
        return x

    def _final_norm(self, x):
        return _rms_norm(x, self.final_norm.get_value(), self.config.rms_norm_eps, self.config.norm_plus_one)

    def _ropes(self, q_pos_bt):
        """(global, local) (cos, sin): Gemma 3's sliding layers have their own rope base."""
        c = self.config
        return (rope_tables(q_pos_bt, c.rope, c.head_dim), rope_tables(q_pos_bt, c.local_rope or c.rope, c.head_dim))

    def _masks_and_ropes(self, q_pos_bt, mask_bts, key_pos_bs):
        """(global, local) variants of (cos, sin, attention bias [B, T, S]): Gemma's sliding
        layers differ. On the "xla" path the mask becomes an additive float32 bias (0 or MASKED)
        once, here: on XLA:CPU a `where` over the attention logits in every layer cost more than
        the attention matmuls. On accelerators it stays boolean (a quarter of the bytes; the
        `where` fuses into the softmax)."""
        c = self.config
        (cos_g, sin_g), (cos_l, sin_l) = self._ropes(q_pos_bt)
        window_mask = mask_bts
        if c.sliding_window:
            # Hugging Face: a key is visible when q_pos - k_pos < sliding_window.
            window_mask = mask_bts & (q_pos_bt[:, :, None] - key_pos_bs[:, None, :] < c.sliding_window)
        if fused_attention.resolve(c.attention) == "xla":
            bias = lambda m: jnp.where(m, jnp.float32(0), jnp.float32(MASKED))  # noqa: E731
        else:
            bias = lambda m: m  # noqa: E731
        return (cos_g, sin_g, bias(mask_bts)), (cos_l, sin_l, bias(window_mask))

    def _run_layers(self, x, q_pos_bt, mask_bts, key_pos_bs, remat: Optional[str] = None, key_blocks=None):
        """All layers, attention over a precomputed [B, T, S] mask (the "xla" path)."""
        global_, local = self._masks_and_ropes(q_pos_bt, mask_bts, key_pos_bs)
        bias = lambda is_sliding: jnp.where(is_sliding, local[2], global_[2])  # noqa: E731
        return self._scan_layers(x, (global_[:2], local[:2]), remat,
                                 lambda is_sliding: dict(bias_bts=bias(is_sliding), key_blocks=key_blocks))

    def _run_layers_fused(self, x, q_pos_bt, rows: TreeRows, impl: str, tree: bool, remat: Optional[str] = None):
        """All layers, attention by a fused kernel (`models.fused_attention`). Gemma's sliding
        layers pick the windowed kernel with a `lax.cond` (the window is part of a kernel's
        static mask)."""
        c = self.config
        attend = functools.partial(fused_attention.attend, rows=rows, impl=impl, tree=tree, scale=c.attn_scale,
                                   softcap=c.attn_logit_softcap)

        def fused(is_sliding):
            if not any(c.layer_is_sliding):
                return functools.partial(attend, window=None)
            return lambda q, k, v: jax.lax.cond(is_sliding, functools.partial(attend, window=c.sliding_window),
                                                functools.partial(attend, window=None), q, k, v)

        return self._scan_layers(x, self._ropes(q_pos_bt), remat,
                                 lambda is_sliding: dict(bias_bts=None, fused=fused(is_sliding)))

    def _scan_layers(self, x, ropes, remat: Optional[str], attention_for):
        """All layers under `lax.scan` over the stacked parameters (no cache). `ropes`: the
        (global, local) (cos, sin); `attention_for(is_sliding)`: a layer's attention arguments of
        `_decoder_layer` (its mask, or a fused kernel)."""
        c = self.config
        dtype = jnp.dtype(c.compute_dtype)
        global_, local = ropes

        def layer(h, xs):
            p, is_sliding = xs
            p = self.layers.layer_weights(p)  # LoRA: merged one layer at a time
            cos, sin = (jnp.where(is_sliding, l_, g_) for l_, g_ in zip(local, global_))
            h, _ = _decoder_layer(c, dtype, p, h, cos, sin, cached=None, **attention_for(is_sliding))
            return h, None

        if remat is not None:
            layer = jax.checkpoint(layer, policy=remat_policy(remat), prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, (self.layers.stacked(), jnp.asarray(c.layer_is_sliding)))
        return x

    def _run_layers_cached(self, x, q_pos_bt, mask_bts, key_pos_bs, cache: KVCache, layer_params: tuple,
                           rows: Optional[TreeRows] = None, impl: str = "xla", shared: Optional[SharedKV] = None):
        """All layers, unrolled; each writes the new tokens' keys and values into its cache
        buffer (in place under donation), then attends over that buffer (and `shared`), or
        (`rows`: a fresh cache) over the new tokens with a fused kernel."""
        c = self.config
        dtype = jnp.dtype(c.compute_dtype)
        if rows is None:
            global_, local = self._masks_and_ropes(q_pos_bt, mask_bts, key_pos_bs)
        else:
            global_, local = ((*rope, None) for rope in self._ropes(q_pos_bt))
        cache_k, cache_v = [], []
        for i, (p, is_sliding, k_buf, v_buf) in enumerate(zip(layer_params, c.layer_is_sliding, cache.k, cache.v)):
            cos, sin, bias = local if is_sliding else global_
            fused = None if rows is None else functools.partial(
                fused_attention.attend, rows=rows, impl=impl, tree=False, scale=c.attn_scale,
                softcap=c.attn_logit_softcap, window=c.sliding_window if is_sliding else None)
            x, (k_buf, v_buf) = _decoder_layer(c, dtype, p, x, cos, sin, bias, (k_buf, v_buf, cache.index),
                                               fused=fused,
                                               shared=None if shared is None else (shared.k[i], shared.v[i]))
            cache_k.append(k_buf)
            cache_v.append(v_buf)
        return x, tuple(cache_k), tuple(cache_v)


_QKVO = "qkvo"  # checkpoint name of the q, k, v and attention-output projections' outputs


def _saveable(x):
    """Name `x` for the "qkvo_saveable" policy (an identity outside a rematerialised pass)."""
    return checkpoint_name(x, _QKVO)


# Our own policies, beside jax.checkpoint_policies'. "qkvo_saveable" keeps the outputs of the
# q, k, v and attention-output projections (N*H + 2*K*H + D floats per token and layer, 2.7 x D
# for SmolLM2) and recomputes the rest: on CPU 5% faster than "nothing_saveable". Keeping the
# MLP's outputs as well was slower there (XLA:CPU reads them back transposed, element by
# element, from the scan's stacked residuals).
_OWN_POLICIES = {"qkvo_saveable": jax.checkpoint_policies.save_only_these_names(_QKVO)}


def remat_policy(name: str):
    """The rematerialisation policy called `name`: one of ours (`_OWN_POLICIES`) or of
    `jax.checkpoint_policies`; a clear error for an unknown name."""
    if name in _OWN_POLICIES:
        return _OWN_POLICIES[name]
    policy = getattr(jax.checkpoint_policies, name, None)
    if not callable(policy) or name.startswith("_"):
        known = sorted([*_OWN_POLICIES, *(n for n in dir(jax.checkpoint_policies)
                                          if n.endswith("saveable"))])
        raise ValueError(f"remat: unknown policy {name!r}; one of {known}")
    return policy


def softcap(x, cap: Optional[float]):
    return x if cap is None else cap * jnp.tanh(x / cap)


def _default_positions(valid_bt, segments_bt):
    T = valid_bt.shape[1]
    idx = jnp.arange(T)[None, :]
    starts = jnp.concatenate(
        [jnp.ones_like(segments_bt[:, :1], bool), segments_bt[:, 1:] != segments_bt[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    count = jnp.cumsum(valid_bt.astype(jnp.int32), axis=1)
    count_before_segment = jnp.take_along_axis(count - valid_bt.astype(jnp.int32), start_idx, axis=1)
    return jnp.maximum(count - count_before_segment - 1, 0)


def _write_slots(buf_bksh, new_bkth, index):
    """buf[:, :, index:index + T] = new, in place. A 16-bit float buffer is written through its
    integer view: XLA:CPU copied the whole buffer at every bfloat16 dynamic_update_slice
    (0.26 ms a layer and step for a 64-row, 256-slot SmolLM2 cache) and writes a uint16 one in
    place (3 us)."""
    new_bkth = new_bkth.astype(buf_bksh.dtype)
    if buf_bksh.dtype.itemsize != 2:
        return jax.lax.dynamic_update_slice(buf_bksh, new_bkth, (0, 0, index, 0))
    bits = lambda x, dtype: jax.lax.bitcast_convert_type(x, dtype)  # noqa: E731
    out = jax.lax.dynamic_update_slice(bits(buf_bksh, jnp.uint16), bits(new_bkth, jnp.uint16), (0, 0, index, 0))
    return bits(out, buf_bksh.dtype)


def _decoder_layer(c: ModelConfig, dtype, p: dict, x, cos, sin, bias_bts, cached, key_blocks=None, fused=None,
                   shared=None):
    """One layer. `cached` is None (attend over the T tokens themselves) or this layer's cache
    (k, v buffers [B, K, S, H], index): the new keys and values are written at slots
    [index, index + T) first, then the queries attend over all S slots (and the shared segment's
    (k, v) [K, P, H], `shared`, after them). Writing before reading
    lets XLA update the buffers in place (a read of the old buffer would force a copy).
    `fused` (q, k, v [B, T, *, H]) -> [B, T, N, H] replaces the full-sequence attention.

    Returns (new x, updated (k, v) buffers or None)."""
    eps, plus_one = c.rms_norm_eps, c.norm_plus_one
    h = _rms_norm(x, p["attn_norm"], eps, plus_one)
    q = _saveable(projection("btd,dnh->btnh", h, p["q"], dtype))
    k = _saveable(projection("btd,dkh->btkh", h, p["k"], dtype))
    v = _saveable(projection("btd,dkh->btkh", h, p["v"], dtype))
    if c.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if c.qk_norm:
        q = _rms_norm(q, p["q_norm"], eps, plus_one)
        k = _rms_norm(k, p["k_norm"], eps, plus_one)
    q = _apply_rope(q, cos, sin)
    k = _apply_rope(k, cos, sin)
    attend = dict(scale=c.attn_scale, softcap=c.attn_logit_softcap, dtype=dtype)
    if fused is not None:
        kv = None
        if cached is not None:  # a fresh cache: written, then the new tokens attend to each other
            k_buf, v_buf, index = cached
            kv = (_write_slots(k_buf, k.transpose(0, 2, 1, 3), index), _write_slots(v_buf, v.transpose(0, 2, 1, 3), index))
        attn = fused(q.astype(dtype), k.astype(dtype), v.astype(dtype))  # [B, T, N, H]
    elif cached is None:
        kv = None
        attn = causal_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), bias_bts, **attend,
                                key_blocks=key_blocks)
    else:
        k_buf, v_buf, index = cached
        k_buf = _write_slots(k_buf, k.transpose(0, 2, 1, 3), index)
        v_buf = _write_slots(v_buf, v.transpose(0, 2, 1, 3), index)
        kv = (k_buf, v_buf)
        attn = (attention(q, k_buf, v_buf, bias_bts, **attend) if shared is None
                else attention_with_shared(q, k_buf, v_buf, *shared, bias_bts, **attend))
    # A plain [B*T, N*H] x [N*H, D] matmul on the row-major weight (a free reshape): with an
    # einsum over (n, h), XLA:CPU chose to transpose the weight instead, a copy at every step.
    B, T, N, H = q.shape
    attn = (attn if fused is not None else attn.transpose(0, 2, 1, 3, 4)).reshape(B * T, N * H)
    out = _saveable(projection("bm,md->bd", attn, p["o"].reshape(N * H, -1), dtype)).reshape(B, T, -1)
    if c.sandwich_norms:
        out = _rms_norm(out, p["attn_out_norm"], eps, plus_one)
    x = x + out
    h = _rms_norm(x, p["mlp_norm"], eps, plus_one)
    gate = projection("btd,df->btf", h, p["gate"], dtype)
    up = projection("btd,df->btf", h, p["up"], dtype)
    act = jax.nn.silu(gate) if c.activation == "silu" else jax.nn.gelu(gate, approximate=True)
    out = projection("btf,fd->btd", act * up, p["down"], dtype)
    if c.sandwich_norms:
        out = _rms_norm(out, p["mlp_out_norm"], eps, plus_one)
    return x + out, kv
