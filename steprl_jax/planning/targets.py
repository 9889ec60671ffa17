"""Accelerator slices by their cloud names, and compile-only devices for them.

    target("v5p-16")  ->  Target(kind="v5p", chips=8, topology="v5p:2x2x2", ...)
    devices(target)   ->  libtpu's compile-only devices of that topology (no TPU needed)

Names follow Google Cloud's accelerator types: `v5litepod-N` / `v5e-N` and `v6e-N` count chips;
`v4-N` and `v5p-N` count TensorCores, two per chip. Each chip's HBM, peak dense bf16 rate and HBM
bandwidth are the published figures:

  v4   32 GiB,  275 TFLOP/s, 1,228 GB/s   cloud.google.com/tpu/docs/v4
  v5e  16 GiB,  197 TFLOP/s,   819 GB/s   cloud.google.com/tpu/docs/v5e
  v5p  95 GiB,  459 TFLOP/s, 2,765 GB/s   cloud.google.com/tpu/docs/v5p
  v6e  32 GiB,  918 TFLOP/s, 1,640 GB/s   cloud.google.com/tpu/docs/v6e
  H100 80 GiB,  989 TFLOP/s, 3,350 GB/s   NVIDIA H100 SXM datasheet (dense bf16)
  H200 141 GiB, 989 TFLOP/s, 4,800 GB/s   NVIDIA H200 SXM datasheet (dense bf16)

"cpu" is the stand-in: virtual CPU devices, figures of the order of magnitude only.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    kind: str
    hbm: int  # bytes per chip
    bf16_flops: float  # peak dense bf16, per second
    hbm_bandwidth: float  # bytes per second
    cores_per_name: int  # how many of the name's N make one chip (v4/v5p count TensorCores)
    chips_per_host: int
    dims: int  # 2-d (v5e, v6e) or 3-d (v4, v5p) torus


CHIPS = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1228e9, 2, 4, 3),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 1, 4, 2),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 2, 4, 3),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1640e9, 1, 4, 2),
    "h100": Chip("h100", 80 * GIB, 989e12, 3350e9, 1, 8, 1),
    "h200": Chip("h200", 141 * GIB, 989e12, 4800e9, 1, 8, 1),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given: "v5p-16", "v5litepod-8", "cpu-8"
    chip: Chip
    chips: int
    topology: str  # libtpu's topology name, "v5e:2x4"; "" for CPU/GPU

    @property
    def platform(self) -> str:
        return "tpu" if self.topology else "gpu" if self.chip.kind in ("h100", "h200") else "cpu"

    @property
    def host_chips(self) -> int:
        """Chips per host: v5e/v6e slices up to 8 chips are one host, larger ones 4 a host."""
        if self.chip.dims == 2 and self.chips <= 8:
            return self.chips
        return min(self.chips, self.chip.chips_per_host)

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.host_chips)

    def one_host(self) -> "Target":
        """The slice of one host's chips (a sampler's devices: programs compile on their own
        topology, whose device ids the compiler numbers from 0)."""
        if self.hosts == 1:
            return self
        shape = _shape(self.host_chips, self.chip.dims)
        return Target(f"{self.name} (one host)", self.chip, self.host_chips,
                      f"{self.chip.kind}:" + "x".join(map(str, shape)))


def _shape(chips: int, dims: int) -> list:
    """The slice's torus (v5e-8 -> [2, 4], v5p-16 -> [2, 2, 2], v5p-32 -> [2, 2, 4])."""
    if dims == 2:
        a = 1
        while (a * 2) ** 2 <= chips:
            a *= 2
        return [a, chips // a]
    sizes = [2, 2, 1] if chips >= 4 else [1, 1, chips]
    while sizes[0] * sizes[1] * sizes[2] < chips:
        smallest = min(sizes)
        i = max(k for k, v in enumerate(sizes) if v == smallest)
        sizes[i] *= 2
    return sizes


def target(name: str) -> Target:
    """The `Target` of a cloud accelerator name, or "cpu"/"cpu-N" (N virtual devices, default 8),
    or "h100-N"/"h200-N" (one host: N <= 8; compiled by the CUDA plugin, see `planning/gpu.py`)."""
    m = re.fullmatch(r"([a-z0-9]+)(?:-(\d+))?", name.strip().lower())
    if not m:
        raise ValueError(f"--target: {name!r} is not NAME-N (e.g. v5p-16, v5litepod-8, v6e-8, cpu-8)")
    kind, n = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2) or 8)
    if kind == "cpu":
        return Target(name, Chip("cpu", 0, 0.0, 0.0, 1, n, 1), n, "")
    if kind not in CHIPS:
        raise ValueError(f"--target: unknown accelerator {m.group(1)!r}; one of "
                         f"{', '.join(sorted(CHIPS) + ['v5litepod', 'cpu'])}")
    chip = CHIPS[kind]
    if n % chip.cores_per_name or n < chip.cores_per_name:
        raise ValueError(f"--target: {name}: {kind} slices count {chip.cores_per_name} per chip")
    chips = n // chip.cores_per_name
    if chips & (chips - 1):
        raise ValueError(f"--target: {name}: {chips} chips is not a power of two")
    topology = "" if kind.startswith("h") else f"{kind}:" + "x".join(map(str, _shape(chips, chip.dims)))
    return Target(name, chip, chips, topology)


def not_installed(modules: tuple, what: str, extra: str) -> Optional[str]:
    """None when one of `modules` can be imported here (looked up, not imported: an optional
    compiler stays out of the process until it is used), else a line naming the extra."""
    import importlib.util

    for module in modules:
        try:
            if importlib.util.find_spec(module) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return f"{what} is not installed (pip install -e \".[{extra}]\" works on a CPU host)"


def libtpu_available() -> Optional[str]:
    """None when libtpu can compile here, else why not (one line)."""
    return not_installed(("libtpu",), "libtpu", "tpu")


def devices(t: Target):
    """Compile-only devices for a TPU target (libtpu) or a GPU one (the CUDA plugin, one host of
    up to 8 GPUs: `planning/gpu.py`); no accelerator needed."""
    if t.platform == "gpu":
        from steprl_jax.planning import gpu

        if t.chips > 8:
            raise ValueError(f"--target {t.name}: GPU plans cover one host (at most 8 GPUs)")
        return gpu.devices(t.chip.kind, t.chips)
    from jax.experimental import topologies

    # libtpu looks for a TPU VM's metadata first; on any other host these keep it quiet. Several
    # processes may compile at once (no chip is opened): lift libtpu's one-process lock.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["TPU_ACCELERATOR_TYPE"] = f"{t.chip.kind.replace('v5e', 'v5litepod')}-{t.chips}"
    n = t.host_chips
    per_host = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[n]
    # v4's two TensorCores per chip act as one device ("megacore"), as on a v4 VM.
    config = "megacore" if t.chip.kind == "v4" else "default"
    topo = topologies.get_topology_desc(platform="tpu", topology_name=t.topology, chip_config_name=config,
                                        chips_per_host_bounds=per_host, num_slices=1, wrap=(False, False, False))
    return list(topo.devices)
