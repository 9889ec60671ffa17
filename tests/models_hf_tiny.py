"""Tiny randomly initialised transformers checkpoints, one per family, written to disk (test helper)."""
import numpy as np
import torch
import transformers

# One small config per family; each exercises that family's switches.
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 20_000.0}),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=64),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=64,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
}


def make_hf_model(family: str, seed: int = 0):
    """A random transformers model whose norms and biases are perturbed too (zeros/ones hide bugs)."""
    torch.manual_seed(seed)
    config = HF_CONFIGS[family]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def save_hf_model(family: str, directory, seed: int = 0):
    model = make_hf_model(family, seed)
    model.save_pretrained(str(directory))
    return model


def hf_logits(model, ids_bt, mask_bt=None, positions_bt=None) -> np.ndarray:
    kwargs = {}
    if mask_bt is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(mask_bt), dtype=torch.long)
    if positions_bt is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions_bt), dtype=torch.long)
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids_bt), dtype=torch.long), **kwargs).logits.float().numpy()
