"""Beyond one process: JAX's multi-controller runtime, the global mesh, and moving host data
and parameters between processes.

    distributed.initialize(config.distributed)        # first, before anything touches a device
    spec = distributed.MeshSpec.from_config(config.mesh)  # read once; the jobs hand `spec` down
    mesh = distributed.train_mesh(spec)               # None: one device, no mesh (the default)
    model, tokenizer = distributed.load_policy(config)  # straight onto the trainer's mesh (if any)
    local = distributed.sampling_copy(model, distributed.sampler_bridge(spec))  # for the sampler

Every process runs the same program (`jax.distributed`; TPU pods, multi-GPU hosts, local CPU
processes over 127.0.0.1). The trainer's state lives on the global mesh; each process samples on
its own devices with a full copy of the parameters (or one sharded over its local devices), moved
there by one jitted reshard (device to device, collectives included), never through host memory.
Host objects (rollout records) travel between processes as JSON over `process_allgather`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from steprl_jax.errors import ConfigError
from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, MESH_AXES, state_shardings

log = logging.getLogger(__name__)

MODES = ("off", "auto", "on")


# ----------------------------------------------------------------------------- processes
def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize(cfg) -> bool:
    """Start `jax.distributed` as `cfg` (config.distributed) says; True if it was started.

    mode "off": one process. "on": `jax.distributed.initialize` with `coordinator_address`,
    `num_processes` and `process_id` from cfg, else from JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; what is still unknown is left to JAX's cluster
    detection (TPU VMs, SLURM, Open MPI). "auto": "on" when a coordinator address or a process
    count above 1 is given, or on a TPU VM with several workers. Timeouts bound the wait for
    the other processes at start-up and the time a dead process goes unnoticed.
    """
    mode = str(cfg.get("mode", "off"))
    if mode not in MODES:
        raise ConfigError(f"config.distributed.mode: {mode!r} is not one of {MODES}")
    address = cfg.get("coordinator_address", "") or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    num = int(cfg.get("num_processes", 0)) or _env_int("JAX_NUM_PROCESSES")
    pid = int(cfg.get("process_id", -1))
    pid = pid if pid >= 0 else _env_int("JAX_PROCESS_ID")
    if mode == "auto":
        workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
        mode = "on" if address or (num or 1) > 1 or "," in workers else "off"
    if mode == "off":
        return False
    if jax.distributed.is_initialized():
        return True
    # Cross-process collectives of the CPU backend (tests, CPU clusters); the flag is read by the
    # CPU client only, so it is harmless on TPU and GPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address or None, num_processes=num, process_id=pid,
        initialization_timeout=int(cfg.get("initialization_timeout_s", 300)),
        heartbeat_timeout_seconds=int(cfg.get("heartbeat_timeout_s", 100)),
        shutdown_timeout_seconds=int(cfg.get("shutdown_timeout_s", 300)))
    log.info("distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def is_primary() -> bool:
    """Process 0 writes what there is one of: metrics, evaluations, summaries, exports."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather_json(obj: Any) -> list:
    """[obj of process 0, obj of process 1, ...] on every process (JSON-serialisable objects)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj, ensure_ascii=False).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
    padded = np.zeros(1 << max(10, int(sizes.max() - 1).bit_length()), np.uint8)  # few sizes: few programs
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(bytes(gathered[p, :int(sizes[p])]).decode()) for p in range(len(sizes))]


def share(items: Sequence, process: Optional[int] = None, count: Optional[int] = None) -> list:
    """(global index, item) pairs of this process's share: items p, p + P, p + 2P, ..."""
    p = jax.process_index() if process is None else process
    n = jax.process_count() if count is None else count
    return [(i, item) for i, item in enumerate(items) if i % n == p]


def host_copy(tree):
    """NumPy copies of a pytree of (possibly multi-process) arrays, the same on every process."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


# ----------------------------------------------------------------------------- meshes
def _sizes(cfg, where: str) -> tuple[int, ...]:
    sizes = tuple(int(cfg.get(axis, 1)) for axis in MESH_AXES)
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
        raise ConfigError(f"{where}: axis sizes {dict(zip(MESH_AXES, sizes))} must be positive, with at most "
                         f"one -1 (the devices left over)")
    return sizes


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """`config.mesh`, read once: the trainer's axis sizes over every device and the sampler's
    (`config.mesh.sampler`) over each process's own, in MESH_AXES order (-1: the devices left over)."""

    train: tuple[int, ...] = (1, 1, 1)
    sampler: tuple[int, ...] = (1, 1, 1)

    @classmethod
    def from_config(cls, cfg) -> "MeshSpec":
        """From the `mesh` section (None: one device); a ConfigError names the field at fault."""
        cfg = cfg or {}
        return cls(train=_sizes(cfg, "config.mesh"), sampler=_sizes(cfg.get("sampler", {}), "config.mesh.sampler"))


def mesh_of(sizes: Sequence[int], devices: Sequence, where: str) -> Mesh:
    """A (data, fsdp, tensor) mesh of `sizes` (-1: the rest) over `devices`."""
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigError(f"{where}: {dict(zip(MESH_AXES, sizes))} does not divide {len(devices)} devices")
        sizes = tuple(len(devices) // known if s == -1 else s for s in sizes)
    total = int(np.prod(sizes))
    if total > len(devices):
        raise ConfigError(f"{where}: {dict(zip(MESH_AXES, sizes))} needs {total} devices, there are {len(devices)}")
    return Mesh(np.asarray(list(devices)[:total], dtype=object).reshape(sizes), MESH_AXES)


def train_mesh(spec: MeshSpec) -> Optional[Mesh]:
    """The trainer's global mesh; None (one device, no mesh) when every axis is 1 and there is one
    process. With several processes the mesh must hold every device."""
    if spec.train == (1, 1, 1) and jax.process_count() == 1:
        return None
    mesh = mesh_of(spec.train, jax.devices(), "config.mesh")
    if jax.process_count() > 1 and mesh.size != jax.device_count():
        raise ConfigError(f"config.mesh: {dict(mesh.shape)} holds {mesh.size} of the {jax.device_count()} devices "
                         f"of {jax.process_count()} processes; a multi-process mesh holds them all (use -1)")
    return mesh


def local_devices_by_process() -> list[list]:
    """Each process's devices in id order (the same list on every process)."""
    by = {}
    for d in jax.devices():
        by.setdefault(d.process_index, []).append(d)
    return [sorted(by[p], key=lambda d: d.id) for p in sorted(by)]


def sampler_mesh(spec: MeshSpec) -> Optional[Mesh]:
    """The sampler's mesh over this process's devices (None: one device)."""
    mesh = mesh_of(spec.sampler, jax.local_devices(), "config.mesh.sampler")
    return mesh if mesh.size > 1 else None


def host_split_spec(shape, n: int) -> PartitionSpec:
    """On a ("process", "local") mesh: a whole copy per process, split over its n local devices
    along the largest axis they divide (else whole)."""
    dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0] if n > 1 else []
    spec = [None] * len(shape)
    if dims:
        spec[int(dims[0])] = "local"
    return PartitionSpec(*spec)


class SamplerBridge:
    """Moves the trainer's parameters (global arrays on any mesh) to this process's sampler: a
    full copy on each process, placed by config.mesh.sampler (axis sizes over the local
    devices; all 1: the first local device).

    Two device-to-device moves. First one jitted reshard over every device (a cross-process
    reshard must keep the device set): each tensor replicated over the processes and split over
    each process's devices, so that every process holds a whole copy of it. Then, inside the
    process, onto the sampler's own devices and layout.
    """

    def __init__(self, spec: MeshSpec, rules: dict = LOGICAL_AXIS_RULES):
        self.rules = rules
        self.local_mesh = mesh_of(spec.sampler, jax.local_devices(), "config.mesh.sampler")
        groups = local_devices_by_process()
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"processes have different device counts: {[len(g) for g in groups]}")
        self._stacked = Mesh(np.asarray(groups, dtype=object), ("process", "local"))
        self._own = Mesh(np.asarray(groups[jax.process_index()], dtype=object), ("local",))
        self._reshard = {}

    def __call__(self, state):
        """A pytree of nnx Variables of global arrays -> the same on the sampler's devices."""
        from flax import nnx

        is_var = lambda x: isinstance(x, nnx.Variable)
        values = jax.tree.map(lambda v: v.get_value() if is_var(v) else v, state, is_leaf=is_var)
        target = state_shardings(state, self.local_mesh, self.rules)
        if jax.process_count() == 1:  # one process: a plain device-to-device move (any device sets)
            moved = jax.tree.map(lambda v, s: (s.get_value() if is_var(s) else s), values, target, is_leaf=is_var)
            out = jax.device_put(values, moved)
            # the same sharding returns the very array: copy it, the trainer donates its buffers
            out = jax.tree.map(lambda o, v: jax.numpy.copy(o) if o is v else o, out, values)
            return jax.tree.map(lambda var, x: var.replace(x) if is_var(var) else x, state, out, is_leaf=is_var)
        key = jax.tree.structure(values)
        if key not in self._reshard:  # one program per parameter tree
            n = self._stacked.shape["local"]
            out = jax.tree.map(lambda x: NamedSharding(self._stacked, host_split_spec(x.shape, n)), values)
            self._reshard[key] = jax.jit(lambda x: x, out_shardings=out)
        moved = self._reshard[key](values)

        def to_sampler(var, array, sharding):
            sharding = sharding.get_value() if is_var(sharding) else sharding
            own = jax.make_array_from_single_device_arrays(
                array.shape, NamedSharding(self._own, array.sharding.spec),
                [s.data for s in array.addressable_shards])
            out = jax.device_put(own, sharding)
            return var.replace(out) if is_var(var) else out

        return jax.tree.map(to_sampler, state, moved, target, is_leaf=is_var)


def put_global(tree, sharding_of):
    """Host arrays (the same on every process) -> global arrays; `sharding_of(x)` gives each
    leaf's sharding. None leaves stay None."""
    return jax.tree.map(lambda x: None if x is None else jax.device_put(x, sharding_of(x)), tree)


# ----------------------------------------------------------------------------- the policy
def load_policy(config, source: Optional[str] = None, *, sampling: bool = False):
    """`(model, tokenizer)` of `source` (default config.model.source) in config.model.compute_dtype.

    With a trainer mesh (`train_mesh(config.mesh)`) every tensor goes from the file straight to
    its shards on that mesh (every process reads the file and places its own shards), never whole
    on one device; `sampling=True` places it instead where this process samples (config.mesh.sampler
    over its own devices, as `sampling_copy` would), for a job that only samples. Without a trainer
    mesh: `load_pretrained` as ever, the whole model on the default device.
    """
    from steprl_jax.models import load_pretrained

    spec = MeshSpec.from_config(config.get("mesh"))
    mesh = train_mesh(spec)
    if mesh is not None and sampling:
        mesh = mesh_of(spec.sampler, jax.local_devices(), "config.mesh.sampler")
    model, tokenizer = load_pretrained(source or config.model.source, compute_dtype=config.model.compute_dtype,
                                       mesh=mesh)
    if config.model.get("attention"):  # which attention kernels (models/fused_attention.py)
        model.config = model.config.replace(attention=config.model.attention)
    return model, tokenizer


def sampler_bridge(spec: MeshSpec) -> Optional[SamplerBridge]:
    """The bridge from the trainer's mesh to this process's sampler (None without a trainer mesh)."""
    return SamplerBridge(spec) if train_mesh(spec) is not None else None


def sampling_copy(model, bridge: Optional[SamplerBridge]):
    """`model` placed where this process samples with it (its Sampler, a local judge or reward
    model): without a bridge (no trainer mesh) the model itself; else a copy moved by `bridge` from
    the trainer's mesh, the path of every later parameter push. With several processes every
    process must call it (the move is one collective)."""
    if bridge is None:
        return model
    from flax import nnx

    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, bridge(state))
