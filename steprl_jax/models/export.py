"""`export_hf(model, tokenizer, out_dir)`: a directory that transformers and vLLM load.

Writes config.json, model.safetensors (the hf_weights table run in reverse, one
tensor at a time), generation_config.json and the tokenizer files. Everything is
written into a temporary sibling directory that is renamed into place at the end,
so a crash never leaves a half-written checkpoint under `out_dir`.

LoRA adapters (models/lora.py) are written merged into the weights; with `adapters=True`
they are also written unmerged, in PEFT's format, to `out_dir/adapters`
(`export_peft_adapters`): adapter_model.safetensors and adapter_config.json, which
`peft.PeftModel.from_pretrained(<the base model in transformers>, out_dir/adapters)` loads.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import jax.numpy as jnp
import numpy as np

from steprl_jax.models import lora
from steprl_jax.models.config import ModelConfig, RopeConfig
from steprl_jax.models.hf_weights import weight_rules
from steprl_jax.models.safetensors_io import LazyTensors, write_safetensors

_MODEL_TYPES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


def _rope_dict(rope: RopeConfig) -> dict:
    out = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind == "linear":
        out["factor"] = rope.factor
    elif rope.kind == "llama3":
        out.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                   high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position)
    return out


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict:
    """The Hugging Face config.json for `config` (read back by `ModelConfig.from_hf`)."""
    c = config
    model_type, arch = _MODEL_TYPES[c.family]
    hf = {
        "model_type": model_type,
        "architectures": [arch],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": c.qkv_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else (
            c.eos_token_ids[0] if c.eos_token_ids else None),
        "pad_token_id": c.pad_token_id,
        "dtype": dtype,
    }
    act = "silu" if c.activation == "silu" else "gelu_pytorch_tanh"
    layer_types = ["sliding_attention" if s else "full_attention" for s in c.layer_is_sliding]
    if c.family in ("gemma2", "gemma3"):
        scalar = c.query_pre_attn_scalar or c.head_dim
        hf.update(hidden_activation=act, query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  attn_logit_softcapping=c.attn_logit_softcap, final_logit_softcapping=c.final_logit_softcap,
                  sliding_window=c.sliding_window or 4096, layer_types=layer_types)
    else:
        hf["hidden_act"] = act
    if c.family == "gemma3":
        hf["rope_parameters"] = {"full_attention": _rope_dict(c.rope),
                                 "sliding_attention": _rope_dict(c.local_rope or c.rope)}
    else:
        hf["rope_parameters"] = _rope_dict(c.rope)
        hf["rope_theta"] = c.rope.theta
    if c.family in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=bool(c.sliding_window), sliding_window=c.sliding_window,
                  layer_types=layer_types)
        if c.sliding_window:
            hf["max_window_layers"] = next((i for i, s in enumerate(c.layer_is_sliding) if s), c.num_layers)
    return hf


def _param_arrays(model, dtype=None) -> LazyTensors:
    """The HF tensors of `model`, each converted (and cast to `dtype`) only when it is written."""
    config = model.config
    specs, getters = [], {}
    for rule in weight_rules(config):
        value = _attr(model, rule.ours).get_value()
        names = ([rule.hf.format(i=i) for i in range(config.num_layers)] if rule.per_layer else [rule.hf])
        for i, name in enumerate(names):
            out_dtype = np.dtype(dtype or value.dtype)

            def get(value=value, i=i, rule=rule, out_dtype=out_dtype):
                array = np.asarray(value[i] if rule.per_layer else value)
                return np.ascontiguousarray(rule.to_hf(array), dtype=out_dtype)
            shape = rule.to_hf(np.empty(value.shape[1:] if rule.per_layer else value.shape, np.int8)).shape
            specs.append((name, tuple(shape), out_dtype))
            getters[name] = get
    return LazyTensors(specs, lambda name: getters[name]())


def _attr(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def export_hf(model, tokenizer, out_dir: str, *, overwrite: bool = False, dtype: Optional[str] = None,
              adapters: bool = False, base_source: Optional[str] = None) -> str:
    """Write `model` (and `tokenizer`, if given) as a Hugging Face checkpoint directory; returns `out_dir`.

    dtype: dtype of the written tensors ("float32", "bfloat16"); default: the parameters' own dtype.
    A model with LoRA adapters is written merged (what it computes). adapters: they are also
    written to out_dir/adapters in PEFT's format (in their own dtype: they are small), for the base
    model `base_source` (a transformers source; None: unknown, as PEFT writes it).
    """
    if adapters:
        _adapter_rules(model)  # no adapters: refused before anything is written

    def write(tmp):
        tensors = _param_arrays(lora.merged(model), jnp.dtype(dtype) if dtype else None)
        written_dtype = str(tensors.specs()[0][2]) if tensors.specs() else "float32"
        config = hf_config_dict(model.config, dtype=written_dtype)
        _write_json(os.path.join(tmp, "config.json"), config)
        _write_json(os.path.join(tmp, "generation_config.json"), _generation_config(model.config))
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if adapters:
            os.mkdir(os.path.join(tmp, "adapters"))
            _write_peft_adapters(model, os.path.join(tmp, "adapters"), base_source, None)
    return _write_dir(out_dir, overwrite, write)


# ----------------------------------------------------------------------------- PEFT adapters
# PeftModel wraps LoraModel wraps the transformers model: the prefix of the names PEFT saves.
_PEFT_PREFIX = "base_model.model."


def export_peft_adapters(model, out_dir: str, base_source: Optional[str] = None, *, overwrite: bool = False,
                         dtype: Optional[str] = None) -> str:
    """Write `model`'s LoRA adapters as a PEFT adapter directory for the base model `base_source`
    (adapter_config.json's base_model_name_or_path; None: unknown); returns `out_dir`.

    dtype: dtype of the written adapters; default: their own (float32).
    """
    _adapter_rules(model)
    return _write_dir(out_dir, overwrite, lambda tmp: _write_peft_adapters(model, tmp, base_source, dtype))


def _adapter_rules(model) -> list:
    """(target, its hf_weights rule) for each projection that `model` has adapters on."""
    if not lora.has_adapters(model):
        raise ValueError("cannot export LoRA adapters: the model has none (config.lora.rank = 0?); "
                         "export_hf writes its weights")
    rules = {rule.ours: rule for rule in weight_rules(model.config)}
    return [(t, rules["layers." + t]) for t in lora.TARGETS if hasattr(model.layers, lora.PREFIX_A + t)]


def peft_adapter_tensors(model, dtype=None) -> list[tuple[str, np.ndarray]]:
    """The adapters under PEFT's names: per layer and projection, lora_A [r, in] and lora_B [out, r].

    Ours are A [layers, *in, r] and B [layers, r, *out] with W + scale A B over our axes [*in, *out];
    the HF Linear weight is [out, in], its in and out axes flattened in our order (hf_weights'
    to_hf), so PEFT's W + scale B' A' takes A' = A.T and B' = B.T, flattened.
    """
    out = []
    for target, rule in _adapter_rules(model):
        a = np.asarray(getattr(model.layers, lora.PREFIX_A + target).get_value())
        b = np.asarray(getattr(model.layers, lora.PREFIX_B + target).get_value())
        rank, module = a.shape[-1], _PEFT_PREFIX + rule.hf.removesuffix(".weight")
        for i in range(a.shape[0]):
            name = module.format(i=i)
            out += [(name + ".lora_A.weight", a[i].reshape(-1, rank).T),
                    (name + ".lora_B.weight", b[i].reshape(rank, -1).T)]
    return [(name, np.ascontiguousarray(x, dtype=x.dtype if dtype is None else dtype)) for name, x in out]


def peft_adapter_config(model, base_source: Optional[str]) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for `model`'s adapters."""
    rules = _adapter_rules(model)
    rank = int(getattr(model.layers, lora.PREFIX_A + rules[0][0]).get_value().shape[-1])
    alpha = round(model.layers.lora_scale * rank, 9)  # the model keeps only scale = alpha / rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_source,
        "revision": None,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "use_rslora": False,  # PEFT's scaling is then lora_alpha / r, as ours
        "target_modules": sorted(rule.hf.removesuffix(".weight").rsplit(".", 1)[-1] for _, rule in rules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,  # lora_A [r, in], lora_B [out, r], as torch.nn.Linear
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write_peft_adapters(model, directory: str, base_source: Optional[str], dtype) -> None:
    tensors = peft_adapter_tensors(model, np.dtype(jnp.dtype(dtype)) if dtype else None)
    write_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, metadata={"format": "pt"})
    _write_json(os.path.join(directory, "adapter_config.json"), peft_adapter_config(model, base_source))


def _generation_config(config: ModelConfig) -> dict:
    eos = list(config.eos_token_ids)
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos if len(eos) != 1 else eos[0],
        "pad_token_id": config.pad_token_id,
    }


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_dir(out_dir: str, overwrite: bool, write) -> str:
    """`write(tmp)` into a temporary sibling of `out_dir`, then renamed to `out_dir`; returns `out_dir`."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        write(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Rename `tmp` to `out_dir`; an existing `out_dir` is moved aside first and removed after."""
    old = None
    if os.path.exists(out_dir):
        old = out_dir + ".old-" + os.path.basename(tmp).rsplit("-", 1)[-1]
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)
