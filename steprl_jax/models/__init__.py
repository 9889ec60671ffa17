"""The decoder family, its configuration, and checkpoint import/export."""
from steprl_jax.models.config import ConfigError, ModelConfig, RopeConfig
from steprl_jax.models.loading import CheckpointError, build_from_tensors, load_hf_directory
from steprl_jax.models.transformer import KVCache, Transformer

__all__ = [
    "CheckpointError", "ConfigError", "KVCache", "ModelConfig", "RopeConfig", "Transformer",
    "build_from_tensors", "load_hf_directory",
]
