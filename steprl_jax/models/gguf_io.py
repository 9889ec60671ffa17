"""Read a llama.cpp GGUF file: config from its metadata, tensors dequantized to HF layout.

A GGUF file is turned into what a Hugging Face directory gives: an HF config dict
(validated by `ModelConfig.from_hf`) and `fetch(hf_name) -> np.ndarray` in HF
layout, so `build_from_tensors` fills the model the same way for both formats.

Two things llama.cpp's converter does to tensors are undone here:
  * llama: the rows of the Q and K projections are permuted (interleaved rotary
    pairs instead of HF's rotate-half halves);
  * gemma3: every `*norm.weight` is stored with 1 added (llama.cpp's RMSNorm
    scales by w, Gemma's by 1 + w).
Anything in the metadata we do not understand is refused, naming the file and field.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from steprl_jax.models.config import ConfigError, ModelConfig
from steprl_jax.models.gguf_file import read_gguf
from steprl_jax.models.loading import CheckpointError

SUPPORTED_ARCHS = ("llama", "gemma3")

# GGUF tensor name (with "{i}" for the block) -> HF tensor name, per architecture.
_COMMON = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_NAMES = {
    "llama": {**_COMMON, "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"},
    "gemma3": {
        **_COMMON,
        "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
        "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
        "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    },
}

# Metadata keys under "<arch>." that we read; any other key there is refused.
_KNOWN_FIELDS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size",
    "rope.dimension_count", "attention.key_length", "attention.value_length", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length",
}
_KNOWN_FIELDS_BY_ARCH = {
    "llama": _KNOWN_FIELDS,
    "gemma3": _KNOWN_FIELDS | {"attention.sliding_window", "attention.sliding_window_pattern",
                               "final_logit_softcapping", "attn_logit_softcapping"},
}
_FREE_NAMESPACES = ("general.", "tokenizer.", "quantize.", "GGUF.")


class GGUFCheckpoint:
    """One opened GGUF file: `hf_config`, `config`, `tensor_names` (HF) and `fetch(hf_name)`."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        self.path = path
        self.fields, tensors = read_gguf(path)  # every field, the tokenizer's too (read_gguf_tokenizer)
        self.metadata = {name: value for name, value in self.fields.items()
                         if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"{path}: unsupported GGUF architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
        self._tensors = {t.name: t for t in tensors}
        self.hf_config = self._hf_config()
        self.config = ModelConfig.from_hf(self.hf_config, source=path)
        self._hf_to_gguf = self._map_names()

    # ------------------------------------------------------------- config
    def _field(self, key: str, default: Any = None, required: bool = False):
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if required:
            raise ConfigError(f"{self.path}: missing GGUF field {full!r}")
        return default

    def _hf_config(self) -> dict:
        path, arch = self.path, self.arch
        for key, value in self.metadata.items():
            if key.startswith(_FREE_NAMESPACES):
                continue
            if key == "split.count" and value in (0, 1):
                continue
            if key.startswith("split."):
                raise ConfigError(f"{path}: split GGUF files are not supported (field {key!r}); merge them first")
            if not key.startswith(arch + ".") or key[len(arch) + 1:] not in _KNOWN_FIELDS_BY_ARCH[arch]:
                raise ConfigError(f"{path}: unsupported GGUF field {key!r} = {_short(value)}")
        if "rope_freqs.weight" in self._tensors:
            raise ConfigError(f"{path}: tensor 'rope_freqs.weight' (llama3-style rope scaling baked into GGUF) "
                              "is not supported; load the Hugging Face checkpoint instead")

        hidden = int(self._field("embedding_length", required=True))
        heads = int(self._field("attention.head_count", required=True))
        kv_heads = self._field("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise ConfigError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported")
        head_dim = int(self._field("attention.key_length", hidden // heads))
        if int(self._field("attention.value_length", head_dim)) != head_dim:
            raise ConfigError(f"{path}: {arch}.attention.value_length differs from key_length; not supported")
        if int(self._field("rope.dimension_count", head_dim)) != head_dim:
            raise ConfigError(f"{path}: partial rotary ({arch}.rope.dimension_count="
                              f"{self._field('rope.dimension_count')} < head_dim {head_dim}) is not supported")
        layers = int(self._field("block_count", required=True))
        vocab = self._field("vocab_size")
        if vocab is None:
            embed = self._tensors.get("token_embd.weight")
            if embed is None:
                raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
            vocab = int(embed.shape[-1])
        hf = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "num_hidden_layers": layers,
            "intermediate_size": int(self._field("feed_forward_length", required=True)),
            "vocab_size": int(vocab),
            "rms_norm_eps": float(self._field("attention.layer_norm_rms_epsilon", required=True)),
            "max_position_embeddings": int(self._field("context_length", 8192)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
        }
        rope = self._rope()
        if arch == "llama":
            hf.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                      rope_theta=float(self._field("rope.freq_base", 10_000.0)), rope_scaling=rope)
        else:
            hf.update(self._gemma3_fields(hidden, heads, head_dim, layers, rope))
        return hf

    def _rope(self):
        kind = self._field("rope.scaling.type", "none")
        if kind in ("none", None):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._field("rope.scaling.factor", required=True))}
        raise ConfigError(f"{self.path}: unsupported rope scaling type {kind!r} in field "
                          f"'{self.arch}.rope.scaling.type' (supported: none, linear)")

    def _gemma3_fields(self, hidden, heads, head_dim, layers, rope) -> dict:
        pattern = self._field("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # one flag per layer (newer converters)
            if len(pattern) != layers:
                raise ConfigError(f"{self.path}: gemma3.attention.sliding_window_pattern has {len(pattern)} "
                                  f"entries for {layers} layers")
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
        # llama.cpp's rule: the 27B model scales queries by hidden/heads, the others by head_dim.
        scalar = hidden // heads if (hidden, layers) == (5376, 62) else head_dim
        global_rope = {"rope_type": "default", **(rope or {})}
        global_rope["rope_theta"] = float(self._field("rope.freq_base", 1_000_000.0))
        return {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": scalar,
            "sliding_window": int(self._field("attention.sliding_window", required=True)),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "rope_parameters": {
                "full_attention": global_rope,
                # llama.cpp fixes the local layers' rope base at 10k for gemma3 (not stored in the file).
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "final_logit_softcapping": self._field("final_logit_softcapping"),
            "attn_logit_softcapping": self._field("attn_logit_softcapping"),
        }

    # ------------------------------------------------------------ tensors
    def _map_names(self) -> dict[str, str]:
        table = _NAMES[self.arch]
        hf_to_gguf = {}
        layers = self.config.num_layers
        for name in self._tensors:
            hf_name = None
            if name.startswith("blk."):
                parts = name.split(".", 2)
                if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < layers:
                    template = table.get(f"blk.{{i}}.{parts[2]}")
                    hf_name = template.format(i=int(parts[1])) if template else None
            else:
                hf_name = table.get(name)
            if hf_name is None:
                raise CheckpointError(f"{self.path}: unexpected tensor {name!r} for architecture {self.arch!r}")
            hf_to_gguf[hf_name] = name
        return hf_to_gguf

    @property
    def tensor_names(self) -> list[str]:
        return list(self._hf_to_gguf)

    def fetch(self, hf_name: str) -> np.ndarray:
        """Dequantized float32 tensor in HF layout ([out, in] for projections)."""
        from gguf.quants import dequantize

        name = self._hf_to_gguf[hf_name]
        tensor = self._tensors[name]
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
        want = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        weights = np.asarray(weights, np.float32).reshape(want)
        c = self.config
        if self.arch == "llama" and ".attn_q." in name:
            weights = _unpermute_rows(weights, c.num_heads)
        elif self.arch == "llama" and ".attn_k." in name:
            weights = _unpermute_rows(weights, c.num_kv_heads)
        elif self.arch == "gemma3" and name.endswith("norm.weight"):
            weights = weights - 1.0
        return weights


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows (pairs, 2) -> (2, pairs)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def read_gguf_tokenizer(path: str, metadata: Optional[dict] = None):
    """The Hugging Face tokenizer described by a GGUF file's metadata, built without torch.

    transformers' own `gguf_file=` path imports torch; its tokenizer converters do
    not, so we feed them the metadata read by `gguf_file.read_gguf`. Pass the file's
    metadata when it is already read (`GGUFCheckpoint.fields`).
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    metadata = metadata if metadata is not None else read_gguf(path)[0]
    if "tokenizer.ggml.tokens" not in metadata:
        raise CheckpointError(f"{path}: GGUF file carries no tokenizer (field 'tokenizer.ggml.tokens')")
    arch = metadata["general.architecture"]
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                         ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[special] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    tokenizer_config.update(extra)
    if arch.startswith("gemma"):
        from transformers import GemmaTokenizer as cls
    else:
        from transformers import PreTrainedTokenizerFast as cls
    tokenizer = cls(tokenizer_object=backend, **tokenizer_config)
    tokenizer.name_or_path = path
    return tokenizer

