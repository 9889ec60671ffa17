"""Hugging Face parameter names <-> our stacked parameters.

One table says, for every parameter of ours, which HF tensor (per layer) feeds
it and how it is reshaped. Import and export both read this table, so the two
directions cannot drift apart.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from steprl_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorRule:
    ours: str  # attribute path in the model: "embed", "layers.q", ...
    hf: str  # HF name; "{i}" is the layer index for stacked parameters
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _identity(x):
    return x


def weight_rules(config: ModelConfig) -> list[TensorRule]:
    c = config
    N, K, H, D = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size

    def heads_in(n):  # HF [n*H, D] -> ours [D, n, H]
        return lambda w: w.reshape(n, H, D).transpose(2, 0, 1)

    def heads_out(n):  # ours [D, n, H] -> HF [n*H, D]
        return lambda w: w.transpose(1, 2, 0).reshape(n * H, D)

    def bias_in(n):
        return lambda b: b.reshape(n, H)

    def flat(b):
        return b.reshape(-1)

    def transpose(w):
        return w.T

    layer = "model.layers.{i}."
    rules = [
        TensorRule("embed", "model.embed_tokens.weight", _identity, _identity),
        TensorRule("final_norm", "model.norm.weight", _identity, _identity),
        TensorRule("layers.attn_norm", layer + "input_layernorm.weight", _identity, _identity),
        TensorRule("layers.q", layer + "self_attn.q_proj.weight", heads_in(N), heads_out(N)),
        TensorRule("layers.k", layer + "self_attn.k_proj.weight", heads_in(K), heads_out(K)),
        TensorRule("layers.v", layer + "self_attn.v_proj.weight", heads_in(K), heads_out(K)),
        TensorRule("layers.o", layer + "self_attn.o_proj.weight",
                   lambda w: w.reshape(D, N, H).transpose(1, 2, 0),
                   lambda w: w.transpose(2, 0, 1).reshape(D, N * H)),
        TensorRule("layers.gate", layer + "mlp.gate_proj.weight", transpose, transpose),
        TensorRule("layers.up", layer + "mlp.up_proj.weight", transpose, transpose),
        TensorRule("layers.down", layer + "mlp.down_proj.weight", transpose, transpose),
    ]
    if c.qkv_bias:
        rules += [
            TensorRule("layers.q_bias", layer + "self_attn.q_proj.bias", bias_in(N), flat),
            TensorRule("layers.k_bias", layer + "self_attn.k_proj.bias", bias_in(K), flat),
            TensorRule("layers.v_bias", layer + "self_attn.v_proj.bias", bias_in(K), flat),
        ]
    if c.qk_norm:
        rules += [
            TensorRule("layers.q_norm", layer + "self_attn.q_norm.weight", _identity, _identity),
            TensorRule("layers.k_norm", layer + "self_attn.k_norm.weight", _identity, _identity),
        ]
    if c.sandwich_norms:
        rules += [
            TensorRule("layers.attn_out_norm", layer + "post_attention_layernorm.weight", _identity, _identity),
            TensorRule("layers.mlp_norm", layer + "pre_feedforward_layernorm.weight", _identity, _identity),
            TensorRule("layers.mlp_out_norm", layer + "post_feedforward_layernorm.weight", _identity, _identity),
        ]
    else:
        rules.append(TensorRule("layers.mlp_norm", layer + "post_attention_layernorm.weight", _identity, _identity))
    if not c.tie_embeddings:
        rules.append(TensorRule("lm_head", "lm_head.weight", _identity, _identity))
    return rules


# Checkpoints of multimodal wrappers keep the text model under another prefix.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def canonical_name(name: str) -> Optional[str]:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return rest if rest.startswith("lm_head") else "model." + rest
    return name
