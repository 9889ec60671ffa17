"""The decoder family, its configuration, and checkpoint import/export."""
from steprl_jax.models.chat import apply_chat
from steprl_jax.models.config import ConfigError, ModelConfig, RopeConfig
from steprl_jax.models.export import export_hf, export_peft_adapters
from steprl_jax.models.loading import CheckpointError, build_from_tensors, load_hf_directory
from steprl_jax.models.pretrained import PRESETS, load_pretrained
from steprl_jax.models.transformer import KVCache, Transformer

__all__ = [
    "CheckpointError", "ConfigError", "KVCache", "ModelConfig", "PRESETS", "RopeConfig", "Transformer",
    "apply_chat", "build_from_tensors", "export_hf", "export_peft_adapters", "load_hf_directory", "load_pretrained",
]
