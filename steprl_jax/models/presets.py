"""Published architectures by name, as the `config.json` fields of their Hugging Face releases
(text decoders only; Gemma 3's vision tower is not part of the policy). Shapes without weights:
for memory plans and benchmarks (`python -m steprl_jax.plan --model qwen2.5-7b ...`).

    cfg = preset("qwen2.5-7b")          # a ModelConfig, through ModelConfig.from_hf
"""
from __future__ import annotations

from steprl_jax.models.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

HF_CONFIGS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, hidden_act="silu"),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072, hidden_act="silu",
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072, hidden_act="silu", rope_scaling=_LLAMA3_ROPE),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                       max_position_embeddings=32768, hidden_act="silu"),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                       max_position_embeddings=40960, hidden_act="silu"),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                     max_position_embeddings=40960, hidden_act="silu"),
    "gemma-2-27b": dict(model_type="gemma2", vocab_size=256000, hidden_size=4608, intermediate_size=36864,
                        num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                        max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=144, sliding_window=4096, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0),
    "gemma-3-4b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True,
                       max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6),
    "gemma-3-12b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True,
                        max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6),
}


def preset(name: str, **changes) -> ModelConfig:
    """The ModelConfig of a published architecture (`changes`: e.g. compute_dtype="bfloat16")."""
    if name not in HF_CONFIGS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(sorted(HF_CONFIGS))}")
    return ModelConfig.from_hf(HF_CONFIGS[name], source=f"preset {name}").replace(**changes)


def count_params(config: ModelConfig) -> int:
    """The exact parameter count of our model for `config` (abstract: no memory is allocated)."""
    import jax
    import numpy as np
    from flax import nnx

    from steprl_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
