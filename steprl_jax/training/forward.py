"""Model forward to per-token log-probs, aligned with the Batch convention.

`sequence_logprobs(model, tokens)` returns `logp_bt[b, t] = log pi(tokens[b, t] | tokens[b, :t])`
(0 in column 0) through the one log-prob function `ops.logprobs.token_logprobs`, with the
model's own compute dtype and final softcap. The sampler records the same quantity for the
tokens it samples, so on the first update after sampling the ratio is exactly 1.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from steprl_jax.ops.logprobs import token_logprobs


def _shift_right(x_bt):
    return jnp.concatenate([jnp.zeros_like(x_bt[:, :1]), x_bt[:, :-1]], axis=1)


def sequence_logprobs(model, tokens_bt, *, attention_mask_bt=None, temperature=1.0,
                      chunk_size: Optional[int] = None, with_entropy: bool = False,
                      remat: Optional[str] = None, loss_mask_bt=None, positions_bt=None,
                      branch_ids_bt=None, branch_ends_bt=None, key_blocks_bqm=None):
    """Per-token log-probs [B, L] (and entropies of the predicting distribution) of `tokens_bt`;
    `remat`: the layers' rematerialisation policy (see `Transformer.hidden_states`).

    `loss_mask_bt` (aligned like the tokens): only the marked tokens' log-probs are computed,
    the others read 0 (prompt and tool-output tokens need no vocabulary projection; see
    `token_logprobs(where_bt=...)`). None computes every position."""
    cfg = model.config
    hidden_btd = model.hidden_states(tokens_bt, attention_mask_bt=attention_mask_bt, remat=remat,
                                     positions_bt=positions_bt, branch_ids_bt=branch_ids_bt,
                                     branch_ends_bt=branch_ends_bt, key_blocks_bqm=key_blocks_bqm)
    next_bt = jnp.roll(tokens_bt, -1, axis=1)  # position t predicts token t + 1
    where_bt = None
    if loss_mask_bt is not None:  # hidden t is wanted when token t + 1 is; the last never is
        wanted = jnp.asarray(loss_mask_bt) > 0
        where_bt = jnp.concatenate([wanted[:, 1:], jnp.zeros_like(wanted[:, :1])], axis=1)
    dtype = None if cfg.compute_dtype == "float32" else jnp.dtype(cfg.compute_dtype)
    out = token_logprobs(hidden_btd, model.unembedding(), next_bt, temperature=temperature,
                         final_softcap=cfg.final_logit_softcap, chunk_size=chunk_size,
                         with_entropy=with_entropy, compute_dtype=dtype, where_bt=where_bt)
    if with_entropy:
        return _shift_right(out[0]), _shift_right(out[1])
    return _shift_right(out)
