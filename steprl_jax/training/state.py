"""Train state: the NNX model split into a static graph and pytrees, plus optimizer and RNG.

The jitted step receives `TrainState` (a pytree) and closes over the static `graphdef`, so the
compiled code is a pure function of arrays. Parameters are float32 master weights; the model's
`compute_dtype` decides the matmul dtype (bf16 in, float32 accumulate).
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, state_shardings


@struct.dataclass
class TrainState:
    step: jax.Array        # int32 scalar: number of updates applied
    params: Any            # nnx.State of nnx.Param (float32 master weights)
    rest: Any              # nnx.State of non-trainable model variables (often empty)
    opt_state: Any         # optax state
    rng: jax.Array         # uint32[2] PRNG key, advanced once per step


def split_model(model: nnx.Module):
    """(graphdef, params, rest): trainable nnx.Param vs everything else."""
    return nnx.split(model, nnx.Param, ...)


def merge_model(graphdef, params, rest):
    return nnx.merge(graphdef, params, rest)


def create_train_state(model: nnx.Module, tx: optax.GradientTransformation, *, seed: int = 0,
                       mesh: Optional[Mesh] = None, rules: dict = LOGICAL_AXIS_RULES):
    """(graphdef, state, shardings). With a mesh the state is placed by the rules table and
    `shardings` is the matching pytree of NamedShardings (None without a mesh)."""
    graphdef, params, rest = split_model(model)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    if mesh is None:
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                           opt_state=tx.init(params), rng=jax.random.PRNGKey(seed))
        return graphdef, state, None
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest,
                          opt_state=jax.eval_shape(tx.init, params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    shardings = train_state_shardings(abstract, mesh, rules)
    # Parameters placed first; the optimizer state is created on its shards (never whole on a device).
    params, rest = jax.device_put((params, rest), (shardings.params, shardings.rest))
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params=params, rest=rest,
                       opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(params),
                       rng=jax.device_put(jax.random.PRNGKey(seed), shardings.rng))
    return graphdef, state, shardings


def train_state_shardings(state: TrainState, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES):
    """Params and optimizer moments by their logical axes (optax keeps the nnx.Param
    wrappers, hence the metadata); counters, step and RNG replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(step=replicated, params=state_shardings(state.params, mesh, rules),
                      rest=state_shardings(state.rest, mesh, rules),
                      opt_state=state_shardings(state.opt_state, mesh, rules), rng=replicated)
