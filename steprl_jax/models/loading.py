"""Build a Transformer from checkpoint tensors, streaming one tensor at a time.

`build_from_tensors` is the one place that fills a model: the Hugging Face
(safetensors) and GGUF readers only say how to fetch a tensor by its HF name.
The model is created abstractly (no random init), and each stacked parameter
is assembled layer by layer into one host buffer and moved to the device before
the next is read, so peak host memory stays near the size of the parameters.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from steprl_jax.errors import BadInput
from steprl_jax.models.config import ConfigError, ModelConfig
from steprl_jax.models.hf_weights import canonical_name, weight_rules
from steprl_jax.models.safetensors_io import SafetensorsFile
from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, logical_to_spec
from steprl_jax.models.transformer import Transformer


class CheckpointError(BadInput):
    """A checkpoint is missing a tensor, has an unexpected one, or a shape disagrees."""


# Tensors that checkpoints may carry and the model derives or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _attr(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def build_from_tensors(
    config: ModelConfig,
    fetch: Callable[[str], np.ndarray],
    available: Iterable[str],
    *,
    dtype=jnp.float32,
    source: str,
    mesh=None,
    rules: Optional[dict] = None,
) -> Transformer:
    """Fill a Transformer from `fetch(hf_name) -> np.ndarray`; `available` lists the names present.
    With a `mesh`, each tensor goes from its host buffer straight to its shards (placed by the
    logical-axis `rules`): no device ever holds more than its share, and the host at most one
    tensor at a time."""
    available = set(available)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    used = set()
    # jnp.dtype(bfloat16) is ml_dtypes' numpy dtype, so the host buffer is already in the target dtype.
    np_dtype = np.dtype(jnp.dtype(dtype))
    for rule in weight_rules(config):
        param = _attr(model, rule.ours)
        shape = tuple(param.get_value().shape)
        names = [rule.hf.format(i=i) for i in range(config.num_layers)] if rule.per_layer else [rule.hf]
        missing = [n for n in names if n not in available]
        if missing:
            raise CheckpointError(f"{source}: missing tensor {missing[0]!r} (needed for {rule.ours})")
        buffer = np.empty(shape, np_dtype)
        for i, name in enumerate(names):
            try:
                tensor = rule.to_ours(np.asarray(fetch(name)))
            except ValueError as e:  # a reshape that does not fit: the tensor has the wrong size
                raise CheckpointError(f"{source}: tensor {name!r} does not fit {rule.ours} {shape}: {e}") from None
            want = shape[1:] if rule.per_layer else shape
            if tuple(tensor.shape) != want:
                raise CheckpointError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} after conversion, "
                    f"expected {want} for {rule.ours}")
            if rule.per_layer:
                buffer[i] = tensor
            else:
                buffer[...] = tensor
            used.add(name)
            del tensor
        if mesh is None:
            param.set_value(jnp.asarray(buffer, dtype))
        else:
            spec = logical_to_spec(param.get_metadata()["logical_axes"], shape, mesh, rules or LOGICAL_AXIS_RULES)
            param.set_value(jax.device_put(buffer, NamedSharding(mesh, spec)))
        del buffer
    unexpected = sorted(
        n for n in available - used
        if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight" and config.tie_embeddings))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    return model


# ----------------------------------------------------------- HF directories
def read_hf_config(directory: str, **overrides) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {directory}")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
    config = ModelConfig.from_hf(hf, source=path)
    return config.replace(**overrides) if overrides else config


def load_hf_directory(directory: str, *, dtype=jnp.float32, compute_dtype: Optional[str] = None, mesh=None,
                      rules: Optional[dict] = None) -> Transformer:
    """Load `config.json` + `model.safetensors` (or a sharded index) from a directory (with a
    `mesh`: each tensor straight to its shards, see `build_from_tensors`)."""
    overrides = {"compute_dtype": compute_dtype} if compute_dtype else {}
    config = read_hf_config(directory, **overrides)
    files = safetensors_index(directory)
    paths = sorted(set(files.values()))
    source = paths[0] if len(paths) == 1 else os.path.join(directory, "model.safetensors.index.json")
    by_canonical = {canonical_name(n): n for n in files}
    opened: dict = {}

    def fetch(name):
        original = by_canonical[name]
        path = files[original]
        if path not in opened:
            opened[path] = SafetensorsFile(path)
        if original not in opened[path].keys():
            raise CheckpointError(f"{path}: tensor {original!r} is listed in the index but not in the file")
        return opened[path].get(original)

    return build_from_tensors(config, fetch, by_canonical, dtype=dtype, source=source, mesh=mesh, rules=rules)


def safetensors_index(directory: str) -> dict[str, str]:
    """HF tensor name -> path of the safetensors file holding it."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index ({e!r})") from None
        files = {name: os.path.join(directory, shard) for name, shard in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (a shard named in {index_path}) does not exist")
        return files
    if os.path.isfile(single):
        return {name: single for name in SafetensorsFile(single).keys()}
    raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")
