"""The training batch every algorithm fills, and its host-side validator.

Token alignment: column t of every per-token array refers to token `tokens[b, t]`:
`old_logp[b, t] = log pi_old(tokens[b, t] | tokens[b, :t])` (what the sampler records for the
token it sampled). Column 0 has no prediction, so `loss_mask[:, 0]` must be 0. Tool-response,
prompt and padding tokens have `loss_mask` 0. `attention_mask` (1 = real token) marks padding
for the model; None means every token is real.

Shared-prefix rows (training/pack.py): `positions`, `branch_ids` and `branch_ends` pack a tree
of continuations into one row (a prefix, branch 0, and its continuations; continuations of
those, and so on; see `Transformer.hidden_states`); each branch starts with a copy of its
parent's last token, so the next-token alignment above holds inside every branch.
`key_blocks` (`models.attention.key_block_table` of that mask) lets attention skip the key
blocks a block of queries cannot see.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from flax import struct

from steprl_jax.models.attention import KEY_BLOCK, query_block
from steprl_jax.ops.validate import check_finite, check_mask_selects


@struct.dataclass
class Batch:
    tokens: jax.Array                      # int32 [B, L]
    loss_mask: jax.Array                   # float32 [B, L], 1 on trained (action) tokens
    advantages: jax.Array                  # float32 [B, L] (ignored by SFT)
    old_logp: jax.Array                    # float32 [B, L], sampling log-probs (ignored by SFT)
    ref_logp: Optional[jax.Array] = None   # float32 [B, L], for the KL penalty
    is_weight: Optional[jax.Array] = None  # float32 [B, L], off-policy importance weight per token (no gradient)
    attention_mask: Optional[jax.Array] = None  # int32/bool [B, L]
    positions: Optional[jax.Array] = None  # int32 [B, L], None: counted from the start
    branch_ids: Optional[jax.Array] = None  # int32 [B, L], the token's branch (preorder; 0 = the prefix)
    branch_ends: Optional[jax.Array] = None  # int32 [B, L], one past the last branch of its subtree
    key_blocks: Optional[jax.Array] = None  # int32 [B, Q, M], the key blocks each query block sees

    @property
    def shape(self):
        return self.tokens.shape


def make_batch(tokens, loss_mask, advantages=None, old_logp=None, ref_logp=None,
               attention_mask=None, positions=None, branch_ids=None, branch_ends=None, key_blocks=None) -> Batch:
    """Build a Batch of NumPy arrays with the right dtypes (zeros for omitted advantages/logp)."""
    tokens = np.asarray(tokens, np.int32)
    zeros = np.zeros(tokens.shape, np.float32)
    f32 = lambda x: None if x is None else np.asarray(x, np.float32)
    i32 = lambda x: None if x is None else np.asarray(x, np.int32)
    return Batch(tokens=tokens, loss_mask=f32(loss_mask),
                 advantages=zeros if advantages is None else f32(advantages),
                 old_logp=zeros if old_logp is None else f32(old_logp),
                 ref_logp=f32(ref_logp),
                 attention_mask=i32(attention_mask), positions=i32(positions),
                 branch_ids=i32(branch_ids), branch_ends=i32(branch_ends), key_blocks=i32(key_blocks))


def validate_batch(batch: Batch, *, vocab_size: Optional[int] = None,
                   num_microbatches: int = 1, num_data_shards: int = 1) -> None:
    """Raise a ValueError naming the culprit: shapes, NaN/inf, empty or misaligned masks, token
    ids out of range, a batch that does not split into micro-batches x data shards."""
    tokens = np.asarray(batch.tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    for name in ("loss_mask", "advantages", "old_logp", "ref_logp", "is_weight", "attention_mask", "positions",
                 "branch_ids", "branch_ends"):
        value = getattr(batch, name)
        if value is None:
            continue
        if np.shape(value) != tokens.shape:
            raise ValueError(f"{name} shape {np.shape(value)} != tokens shape {tokens.shape}")
        check_finite(name, value)
    if batch.branch_ids is not None and batch.branch_ends is None:
        # without ends the mask assumes two levels (every branch a child of branch 0): a nested
        # tree would silently lose its ancestors
        raise ValueError("branch_ids without branch_ends (training/pack.py makes both)")
    if batch.key_blocks is not None:
        blocks = np.asarray(batch.key_blocks)
        B, T = tokens.shape
        Q, S = T // query_block(T), T // KEY_BLOCK
        if blocks.ndim != 3 or blocks.shape[:2] != (B, Q) or blocks.min() < 0 or blocks.max() >= S:
            raise ValueError(f"key_blocks must be [{B}, {Q}, M] key block indices in [0, {S}), got shape "
                             f"{blocks.shape}, range [{blocks.min()}, {blocks.max()}] (training/pack.py makes them)")
    mask = np.asarray(batch.loss_mask)
    check_mask_selects("loss_mask", mask)
    if np.any(mask < 0):
        raise ValueError("loss_mask must be >= 0")
    if np.any(mask[:, 0] != 0):
        raise ValueError("loss_mask[:, 0] must be 0: the first token has no prediction")
    if batch.attention_mask is not None and np.any((mask != 0) & (np.asarray(
            batch.attention_mask) == 0)):
        raise ValueError("loss_mask selects tokens that attention_mask marks as padding")
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got range "
                         f"[{tokens.min()}, {tokens.max()}]")
    rows = tokens.shape[0]
    if rows % (num_microbatches * num_data_shards):
        raise ValueError(f"batch of {rows} rows does not split into {num_microbatches} "
                         f"micro-batches x {num_data_shards} data shards")
