"""Low-rank adapters (LoRA, Hu et al. 2021) on the attention and MLP projections.

    model = lora.add_adapters(model, LoraConfig(rank=16, alpha=32.0))   # in place
    graphdef, params, rest = split_model(model)    # params: the adapters only; rest: frozen base
    plain = lora.merged(model)                     # W + (alpha / rank) B A: a model without adapters

`add_adapters` turns every parameter of the model into a `Frozen` variable (still sharded by its
logical axes, no longer an `nnx.Param`, so optimizers and gradients never see it) and adds, for
each target projection W of the stacked layers ([layers, *in, *out]), A [layers, *in, rank]
(uniform in +-1/sqrt(fan_in), as PEFT's default) and B [layers, rank, *out] = 0: at creation the
model computes exactly what the base model does. The layers merge W + scale * A B one layer at a
time inside the forward (`merge_layer`), so no second copy of all the weights is kept. The
sampler and the export take `merged(model)`, a plain model.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from steprl_jax.errors import ConfigError

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# how many leading (after "layers") axes of each projection are its input axes
_INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
PREFIX_A, PREFIX_B = "lora_a_", "lora_b_"


class Frozen(nnx.Variable):
    """A base-model weight under LoRA: kept, sharded, never trained."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple = TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora targets {list(self.targets)}: each must be one of {TARGETS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, c) -> "LoraConfig | None":
        """config.lora (rank 0: off)."""
        if c is not None and int(c.get("rank", 0)) < 0:  # not "off": a negative rank is a typo
            raise ConfigError(f"config.lora.rank: {c.get('rank')} is not allowed "
                              f"(an integer >= 0; 0: no adapters, every weight trains)")
        if c is not None and c.get("export_adapters", False) and int(c.get("rank", 0)) <= 0:
            raise ValueError("lora.export_adapters writes LoRA adapters, and lora.rank = 0 trains none: "
                             "set lora.rank > 0 or lora.export_adapters = False")
        if c is None or int(c.get("rank", 0)) <= 0:
            return None
        return cls(rank=int(c.rank), alpha=float(c.alpha), targets=tuple(c.targets))


def has_adapters(model) -> bool:
    return getattr(model.layers, "lora_scale", None) is not None


def _freeze_all(module) -> None:
    for name, value in list(vars(module).items()):
        if isinstance(value, nnx.Param):
            setattr(module, name, Frozen(value.get_value(), **value.get_metadata()))


def add_adapters(model, cfg: LoraConfig, seed: int = 0):
    """Freeze `model`'s parameters and add zero-effect adapters to its layers (in place)."""
    if has_adapters(model):
        raise ValueError("the model already has LoRA adapters")
    layers = model.layers
    key = jax.random.PRNGKey(seed)
    for i, name in enumerate(cfg.targets):
        w = getattr(layers, name)
        shape, axes = w.get_value().shape, tuple(w.get_metadata()["logical_axes"])
        n_in = _INPUT_AXES[name]
        in_shape, out_shape = shape[1:1 + n_in], shape[1 + n_in:]
        bound = 1.0 / math.sqrt(int(np.prod(in_shape)))
        a = jax.random.uniform(jax.random.fold_in(key, i), (shape[0], *in_shape, cfg.rank), jnp.float32,
                               -bound, bound)
        setattr(layers, PREFIX_A + name, nnx.Param(a, logical_axes=(axes[0], *axes[1:1 + n_in], None)))
        setattr(layers, PREFIX_B + name, nnx.Param(jnp.zeros((shape[0], cfg.rank, *out_shape), jnp.float32),
                                                    logical_axes=(axes[0], None, *axes[1 + n_in:])))
    _freeze_all(model)
    _freeze_all(layers)
    for name in (n for n in vars(layers) if n.startswith(PREFIX_A) or n.startswith(PREFIX_B)):
        v = getattr(layers, name)
        setattr(layers, name, nnx.Param(v.get_value(), **v.get_metadata()))  # the adapters train
    layers.lora_scale = float(cfg.scale)
    return model


def _delta(a, b, n_lead: int, scale: float):
    """scale * A B for one projection: A [*lead, *in, r], B [*lead, r, *out], in float32."""
    lead = a.shape[:n_lead]
    in_shape, r, out_shape = a.shape[n_lead:-1], a.shape[-1], b.shape[n_lead + 1:]
    a2 = a.reshape(*lead, int(np.prod(in_shape)), r).astype(jnp.float32)
    b2 = b.reshape(*lead, r, int(np.prod(out_shape))).astype(jnp.float32)
    return (scale * jnp.matmul(a2, b2)).reshape(*lead, *in_shape, *out_shape)


def merge_layer(p: dict, scale) -> dict:
    """One layer's (or the stacked layers', `scale` then applies alike) parameter dict with its
    adapter entries folded into the weights they adapt; a dict without adapters is returned as is."""
    names = [k[len(PREFIX_A):] for k in p if k.startswith(PREFIX_A)]
    if not names:
        return p
    out = {k: v for k, v in p.items() if not k.startswith(PREFIX_A) and not k.startswith(PREFIX_B)}
    for name in names:
        a, b, w = p[PREFIX_A + name], p[PREFIX_B + name], p[name]
        n_lead = a.ndim - 1 - _INPUT_AXES[name]  # 0 for one layer's weights, 1 for the stacked layers
        out[name] = (w.astype(jnp.float32) + _delta(a, b, n_lead, scale)).astype(w.dtype)
    return out


def merged(model):
    """A plain model (no adapters, nnx.Param everywhere) computing what `model` computes; its
    arrays are new where merged and shared elsewhere. A model without adapters is returned as is."""
    if not has_adapters(model):
        return model
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)  # a second module tree on the same arrays
    layers = out.layers
    stacked = {name: v.get_value() for name, v in vars(layers).items() if isinstance(v, nnx.Variable)}
    weights = merge_layer(stacked, layers.lora_scale)
    for name in list(vars(layers)):
        if name.startswith(PREFIX_A) or name.startswith(PREFIX_B):
            delattr(layers, name)
    for name, v in list(vars(layers).items()):
        if isinstance(v, nnx.Variable):
            setattr(layers, name, nnx.Param(weights[name], **v.get_metadata()))
    del layers.lora_scale
    for name, v in list(vars(out).items()):
        if isinstance(v, Frozen):
            setattr(out, name, nnx.Param(v.get_value(), **v.get_metadata()))
    return out
