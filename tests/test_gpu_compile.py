"""Deviceless GPU compilation (the CUDA plugin's compile-only devices, the `gpu` extra): a matmul
sharded over two H100s compiles with sane per-device memory figures, and cuDNN's fused causal
attention compiles for one H100. No GPU is needed; see steprl_jax/planning/gpu.py for what such a
compile does not check."""
import importlib.util

import pytest

_PLUGIN = next((m for m in ("jax_cuda12_plugin", "jax_cuda13_plugin") if importlib.util.find_spec(m)),
               "jax_cuda12_plugin")
pytest.importorskip(_PLUGIN, reason="no GPU compiler here: the JAX CUDA plugin is not installed "
                                    "(pip install -e '.[gpu]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

from steprl_jax.planning import gpu  # noqa: E402


def test_target_config_names_each_gpu_and_its_memory():
    assert 'name: "NVIDIA H100' in gpu.target_config("h100") and str(80 << 30) in gpu.target_config("h100")
    assert 'name: "NVIDIA H200' in gpu.target_config("h200") and str(141 << 30) in gpu.target_config("h200")
    with pytest.raises(ValueError):
        gpu.devices("a100", 1)
    with pytest.raises(ValueError):
        gpu.devices("h100", 9)


def test_sharded_matmul_compiles_for_two_h100s():
    devs = gpu.devices("h100", 2)
    assert len(devs) == 2 and all("H100" in d.device_kind for d in devs)
    mesh = Mesh(devs, ("data",))
    M, K, N = 256, 512, 1024
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: jnp.sum(jax.nn.gelu(x @ w).astype(jnp.float32))).lower(x, w).compile()
    stats = compiled.memory_analysis()
    assert stats.argument_size_in_bytes == (M // 2 * K + K * N) * 2  # per device: half of x, all of w
    assert stats.output_size_in_bytes == 4
    assert 0 < stats.temp_size_in_bytes < 64 << 20
    assert "all-reduce" in compiled.as_text()  # the two halves' sums meet


def test_cudnn_causal_attention_compiles_for_one_h100():
    (dev,) = gpu.devices("h100", 1)
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16, sharding=SingleDeviceSharding(dev))
    attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    compiled = attend.lower(q, q, q).compile()
    assert "__cudnn$fmha" in compiled.as_text()
    stats = compiled.memory_analysis()
    assert stats.argument_size_in_bytes == 3 * 2 * 1024 * 8 * 128 * 2
    assert stats.output_size_in_bytes == 2 * 1024 * 8 * 128 * 2
