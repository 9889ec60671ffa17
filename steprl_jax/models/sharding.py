"""Sharding is a table: logical axis names -> mesh axes.

Every parameter carries `logical_axes` metadata (see transformer.py). Changing
from FSDP to tensor parallelism, or from 8 CPU devices to a TPU pod, is a change
of `rules`, never of model code. A logical axis whose size does not divide the
mesh axes it maps to is left replicated (e.g. 3 KV heads on a tensor axis of 2).
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)
LOGICAL_AXIS_RULES: dict = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "kv": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,
}

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(data: int = 1, fsdp: Optional[int] = None, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh; `fsdp` defaults to the devices left over."""
    devices = list(devices if devices is not None else jax.devices())
    if fsdp is None:
        fsdp = len(devices) // (data * tensor)
    if data * fsdp * tensor != len(devices):
        raise ValueError(f"mesh {data}x{fsdp}x{tensor} does not match {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def logical_to_spec(axes: Sequence[Optional[str]], shape, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES) -> PartitionSpec:
    spec, taken = [], set()
    for name, size in zip(axes, shape):
        mesh_axes = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; rules cover {sorted(rules)}")
        if mesh_axes is None:
            spec.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and a not in taken)
        devices = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if devices == 1 or size % devices:
            spec.append(None)
            continue
        taken.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def state_shardings(state, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES):
    """NamedShardings for an nnx State (or any pytree of Variables/arrays).

    Variables without `logical_axes` metadata (optimizer counters, scalars) are replicated.
    """
    def one(x):
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("logical_axes")
            value = x.get_value()
            spec = logical_to_spec(axes, value.shape, mesh, rules) if axes else PartitionSpec()
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES) -> nnx.Module:
    """Place a model's parameters on `mesh` by the rules table (in place; returns the model)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    nnx.update(model, state)
    return model


def batch_sharding(mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES, ndim: int = 2) -> NamedSharding:
    """[batch, length, ...] arrays: batch over the data axes, the rest replicated."""
    axes = rules["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if a in mesh.shape)
    return NamedSharding(mesh, PartitionSpec(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1))))
