"""Compile-only NVIDIA GPU devices: XLA compiles for an H100 or H200 on a host that has no GPU.

    devices("h100", 8)  ->  eight compile-only H100s on one host, for `jax.jit(...).lower(...).compile()`

This is JAX's topology route (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`)
with the CUDA plugin (the `gpu` extra: jax[cuda12]). The plugin takes two options: `topology`
("<slices>x<hosts>x<devices per host>") and `target_config`, a text `stream_executor.GpuTargetConfigProto`
that describes the GPU; this module writes that text from the published figures below. With both, XLA
logs "Found GPU target config and no PjRtClient. Performing a deviceless compilation." The process must
run JAX on the CPU (JAX_PLATFORMS=cpu, set here when JAX has not started): otherwise the plugin checks
the CUDA driver when it loads, fails without a GPU, and never registers its topology.

What a deviceless GPU compile checks: the whole XLA:GPU pipeline for Hopper (sm_90a), so the SPMD
partitioner's collectives, fusion, the Triton gemm and fusion emitters, ptxas on the generated PTX, and
XLA's buffer assignment (memory_analysis: arguments, outputs, temporaries per device).
What it does not check, or counts differently from a compile on a real GPU:
  - Autotuning is off ("Fusion autotuner is disabled", "Autotuning cuBLAS/cuDNN is disabled"): gemm
    tilings and algorithms are XLA's heuristic choices, so temporaries may differ a little. Sorts may
    take a slower algorithm (no deviceless CUB scratch sizes).
  - cuDNN custom calls (jax.nn.dot_product_attention(implementation="cudnn"), the "gpu" attention) are
    not finalised: no cuDNN graph is built, so whether this cuDNN supports the configuration is not
    checked, and the cuDNN workspace (`workspace_size: "0"`, a `u8[0]` output) is missing from
    memory_analysis.
  - Pallas Mosaic GPU kernels stay MLIR inside their `mosaic_gpu_v2` custom call and are compiled to a
    cubin only at run time, so they are not checked for sm_90a here. (Pallas Triton kernels are
    compiled by XLA and are checked.)
  - jax's own "is this GPU new enough" checks (cuDNN's packed layout, head dims over 128) read the
    default backend, which is the CPU here, and answer as for an old GPU.
  - `cost_analysis()` returns None; nothing is run, so nothing about numbers or speed is checked.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10

# Hopper GH100 as sold in the SXM5 H100 and the H200 (the same compute die; only the HBM differs).
#   [WP]  NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100, H100 SXM5 column)
#   [PG]  CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (9.0)
_HOPPER = dict(
    sms=132,  # [WP] H100 SXM5: 132 SMs
    fp32_per_sm=128,  # [WP] 128 FP32 cores per SM
    clock_ghz=1.98,  # max boost SM clock of the SXM parts (1980 MHz)
    l2_bytes=50 * MIB,  # [WP] 50 MB L2
    threads_per_warp=32,  # [PG]
    threads_per_block=1024,  # [PG] also the x and y thread-block dims; z is 64
    threads_per_sm=2048,  # [PG]
    registers_per_sm=64 * KIB,  # [PG] 64K 32-bit registers per SM, all of them usable by one block
    smem_per_sm=228 * KIB,  # [PG] 228 KB shared memory per SM
    smem_per_block=48 * KIB,  # [PG] static limit per block
    smem_per_block_optin=227 * KIB,  # [PG] with cudaFuncAttributeMaxDynamicSharedMemorySize
    grid_x=2**31 - 1, grid_yz=65535,  # [PG] grid dims
    nvlink_links=18,  # [WP] fourth-generation NVLink: 18 links, 900 GB/s
)

# Each GPU's memory and bandwidth, from its datasheet's SXM column (as in targets.CHIPS). `name` is the
# device_kind JAX reports (what code that looks for "H100"/"H200" in device_kind sees).
_GPUS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=80 * GIB, bandwidth=3.35e12),  # NVIDIA H100 datasheet
    "h200": dict(name="NVIDIA H200 141GB HBM3e", memory=141 * GIB, bandwidth=4.8e12),  # NVIDIA H200 datasheet
}

# The cuDNN that jax[cuda12] 0.10 installs is 9.x; fused attention's feature checks read this version.
_CUDNN = (9, 10, 0)


def why_not() -> Optional[str]:
    """None when the CUDA plugin (which holds XLA's GPU compiler) is installed here, else why not."""
    from steprl_jax.planning.targets import not_installed

    return not_installed(("jax_cuda12_plugin", "jax_cuda13_plugin"), "the JAX CUDA plugin", "gpu")


def target_config(chip: str) -> str:
    """A `stream_executor.GpuTargetConfigProto` in text format for an "h100" or "h200"."""
    if chip not in _GPUS:
        raise ValueError(f"no GPU {chip!r}: one of {', '.join(sorted(_GPUS))}")
    g, h = _GPUS[chip], _HOPPER
    return f"""\
gpu_device_info {{
  name: "{g['name']}"
  cuda_compute_capability {{ major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }}  # sm_90a
  core_count: {h['sms']}
  fpus_per_core: {h['fp32_per_sm']}
  clock_rate_ghz: {h['clock_ghz']}
  device_memory_size: {g['memory']}
  memory_bandwidth: {int(g['bandwidth'])}
  l2_cache_size: {h['l2_bytes']}
  threads_per_warp: {h['threads_per_warp']}
  threads_per_block_limit: {h['threads_per_block']}
  threads_per_core_limit: {h['threads_per_sm']}
  thread_dim_limit_x: {h['threads_per_block']}
  thread_dim_limit_y: {h['threads_per_block']}
  thread_dim_limit_z: 64
  block_dim_limit_x: {h['grid_x']}
  block_dim_limit_y: {h['grid_yz']}
  block_dim_limit_z: {h['grid_yz']}
  registers_per_core_limit: {h['registers_per_sm']}
  registers_per_block_limit: {h['registers_per_sm']}
  shared_memory_per_core: {h['smem_per_sm']}
  shared_memory_per_block: {h['smem_per_block']}
  shared_memory_per_block_optin: {h['smem_per_block_optin']}
  device_interconnect_info {{ active_links: {h['nvlink_links']} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: {_CUDNN[0]} minor: {_CUDNN[1]} patch: {_CUDNN[2]} }}
device_description_str: "{g['name']}"
"""


def _run_jax_on_cpu() -> None:
    """Make JAX start on the CPU, or check that it did: the CUDA plugin registers its topology only
    when it skips its driver check, which it does when JAX_PLATFORMS names no GPU platform."""
    if "jax" not in sys.modules:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if platforms not in ("", "cpu"):
            raise ValueError(f"deviceless GPU compilation runs JAX on the CPU, but JAX_PLATFORMS={platforms!r}: "
                             f"unset it or set JAX_PLATFORMS=cpu")
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    import jax
    from jax._src import config, xla_bridge

    if "cuda" in getattr(xla_bridge, "_topology_factories", {}):
        return  # the plugin is registered already: its topology needs nothing more
    platforms = config.jax_platforms.value or ""
    if platforms == "cpu":
        return
    if xla_bridge.backends_are_initialized() or platforms:
        how = (f"started on {jax.default_backend()!r}" if xla_bridge.backends_are_initialized()
               else "is set to start")
        raise ValueError(f"deviceless GPU compilation needs JAX_PLATFORMS=cpu, but JAX {how} with "
                         f"jax_platforms={platforms!r}, where the CUDA plugin checks for a GPU and does not "
                         f"register without one: set JAX_PLATFORMS=cpu before the process imports jax")
    jax.config.update("jax_platforms", "cpu")


def devices(chip: str, count: int) -> list:
    """Compile-only devices for `count` GPUs ("h100" or "h200") on one host, as on an HGX board."""
    if chip not in _GPUS:
        raise ValueError(f"no GPU {chip!r}: one of {', '.join(sorted(_GPUS))}")
    if not 1 <= count <= 8:
        raise ValueError(f"{count} GPUs: one host holds 1 to 8")
    reason = why_not()
    if reason:
        raise RuntimeError(reason)
    _run_jax_on_cpu()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(chip),
                                            topology=f"1x1x{count}")
    except NotImplementedError as e:  # the plugin did not register (JAX started elsewhere first)
        raise ValueError(f"the CUDA plugin has no topology here ({e}): set JAX_PLATFORMS=cpu before jax starts") from e
    return list(topo.devices)
