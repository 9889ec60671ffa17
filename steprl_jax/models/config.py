"""Model configuration: one frozen dataclass for the whole decoder family.

A family (llama, qwen2, qwen3, gemma2, gemma3) is a set of switches on the same
decoder; `ModelConfig.from_hf` reads a Hugging Face `config.json` and refuses
anything it does not implement, so a checkpoint is never half-understood.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from steprl_jax.errors import ConfigError  # also a checkpoint config asking for what the model lacks

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

# HF model_type -> family.
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}

# Attention implementations (models/fused_attention.py says what each runs).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "tpu", "tpu_interpret", "gpu")

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one kind of layer.

    `kind` is "default", "linear" (positions divided by `factor`) or "llama3"
    (frequency-dependent scaling of Llama 3.1).
    """

    theta: float = 10_000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig = RopeConfig()
    # Gemma 3: rope used by sliding-window (local) layers; None = same as `rope`.
    local_rope: Optional[RopeConfig] = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_position_embeddings: int = 8192
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3, Gemma 3
    sandwich_norms: bool = False  # Gemma 2/3: post-attention and pre/post-MLP norms
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w)
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden)
    query_pre_attn_scalar: Optional[float] = None  # None -> head_dim
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    sliding_window: Optional[int] = None
    # One entry per layer: True for a sliding-window (local) layer.
    sliding_layers: tuple = ()
    compute_dtype: str = "float32"  # "float32" (exact) or "bfloat16" (bf16 in, f32 accumulate)
    attention: str = "auto"  # ATTENTION_IMPLEMENTATIONS; "auto": fused kernels on TPU/GPU, "xla" on CPU
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.activation not in ("silu", "gelu_tanh"):
            raise ConfigError(f"unsupported activation {self.activation!r}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ConfigError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attention!r}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ConfigError("sliding_layers must have one entry per layer")
        if any(self.sliding_layers) and not self.sliding_window:
            raise ConfigError("sliding layers need a sliding_window")

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def layer_is_sliding(self) -> tuple:
        return tuple(self.sliding_layers) if self.sliding_layers else (False,) * self.num_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, family: str = "llama", **overrides) -> "ModelConfig":
        """A small random-init config of the given family, for tests."""
        base = dict(
            family=family, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=10_000.0),
            rms_norm_eps=1e-6, tie_embeddings=True, max_position_embeddings=512,
        )
        if family == "qwen2":
            base.update(qkv_bias=True, tie_embeddings=False)
        if family == "qwen3":
            base.update(qk_norm=True)
        if family in ("gemma2", "gemma3"):
            base.update(activation="gelu_tanh", sandwich_norms=True, norm_plus_one=True,
                        embed_scale=True, query_pre_attn_scalar=16.0, sliding_window=8,
                        sliding_layers=(True, False))
        if family == "gemma2":
            base.update(attn_logit_softcap=50.0, final_logit_softcap=30.0)
        if family == "gemma3":
            base.update(qk_norm=True, local_rope=RopeConfig(theta=10_000.0),
                        rope=RopeConfig(theta=1_000_000.0))
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config dict; refuse unsupported features, naming them."""
        hf = dict(hf)
        if "text_config" in hf and hf.get("model_type") == "gemma3":
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
        model_type = hf.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ConfigError(f"{source}: unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}")
        family = _MODEL_TYPES[model_type]

        def need(field):
            if field not in hf or hf[field] is None:
                raise ConfigError(f"{source}: missing field {field!r}")
            return hf[field]

        hidden = need("hidden_size")
        num_heads = need("num_attention_heads")
        num_layers = need("num_hidden_layers")
        head_dim = hf.get("head_dim") or hidden // num_heads
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{source}: unsupported activation {act!r}")
        for flag in ("mlp_bias", "use_bidirectional_attention"):
            if hf.get(flag):
                raise ConfigError(f"{source}: {flag}=True is not supported")
        if family == "llama" and hf.get("attention_bias"):
            raise ConfigError(f"{source}: attention_bias=True is not supported for llama")
        if hf.get("attention_dropout", 0.0):
            pass  # dropout is a training-time choice; we never drop.

        rope_params = hf.get("rope_parameters")
        rope_scaling = hf.get("rope_scaling")
        theta = hf.get("rope_theta")
        local_rope = None
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            # transformers >= 5 keeps one rope dict per attention type (Gemma 3).
            rope = _rope_from_hf(rope_params["full_attention"], None, source)
            if "sliding_attention" in rope_params:
                local_rope = _rope_from_hf(rope_params["sliding_attention"], None, source)
        else:
            rope = _rope_from_hf(rope_params or rope_scaling, theta, source)
        if family == "gemma3" and local_rope is None:
            local_rope = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))

        sliding_layers: tuple = ()
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if family in ("gemma2", "gemma3"):
            if layer_types is None:
                if family == "gemma2":
                    layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
                else:
                    pattern = hf.get("sliding_window_pattern", 6)
                    layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif hf.get("use_sliding_window") and window:
            if layer_types is None:
                max_window_layers = hf.get("max_window_layers", num_layers)
                layer_types = ["sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)]
        else:
            window = None
            layer_types = None
        if layer_types is not None:
            unknown = set(layer_types) - {"sliding_attention", "full_attention"}
            if unknown:
                raise ConfigError(f"{source}: unsupported layer_types {sorted(unknown)}")
            sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
            if not any(sliding_layers):
                sliding_layers, window = (), None

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        gemma = family in ("gemma2", "gemma3")
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope=rope,
            local_rope=local_rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            activation=_ACTIVATIONS[act],
            qkv_bias=family == "qwen2" or (family != "llama" and bool(hf.get("attention_bias", False))),
            qk_norm=family in ("qwen3", "gemma3"),
            sandwich_norms=gemma,
            norm_plus_one=gemma,
            embed_scale=gemma,
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if gemma and hf.get("query_pre_attn_scalar") else None,
            attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
            sliding_window=window,
            sliding_layers=sliding_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
        )


def _rope_from_hf(params: Optional[dict], theta: Optional[float], source: str) -> RopeConfig:
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta if theta is not None else 10_000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    known = {"rope_theta", "rope_type", "type"}
    if kind == "default":
        _refuse_extra(params, known, source)
        return RopeConfig(theta=theta)
    if kind == "linear":
        _refuse_extra(params, known | {"factor"}, source)
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        _refuse_extra(params, known | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, source)
        return RopeConfig(
            theta=theta, kind="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ConfigError(f"{source}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _refuse_extra(params: dict, allowed: set, source: str) -> None:
    extra = sorted(set(params) - allowed)
    if extra:
        raise ConfigError(f"{source}: unsupported rope parameters {extra}")
