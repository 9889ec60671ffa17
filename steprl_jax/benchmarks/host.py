"""The host's measured rates, printed next to every benchmark's ratio: matmul FLOP/s in float32
and bfloat16 (float32 accumulation) and memory bandwidth. Measured in the run, since hosts
differ (AMX or not) and may be shared."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_machine():
    """(rates, bandwidth): float32 and bfloat16 matmul FLOP/s (1024^3, f32 accumulation) and
    memory bandwidth in B/s (the better of a numpy copy, read + write, and a jitted sum, read)."""
    n = 1024
    rates = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jnp.ones((n, n), dtype)
        mm = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
        jax.block_until_ready(mm(a))
        rates[jnp.dtype(dtype).name] = 2 * n ** 3 / median_time(lambda: jax.block_until_ready(mm(a)), 5)
    src = np.ones(64 * 1024 * 1024, np.float32)  # 256 MB
    dst = np.empty_like(src)
    copy_bw = 2 * src.nbytes / median_time(lambda: np.copyto(dst, src), 5)
    big = jnp.asarray(src)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(big))
    sum_bw = big.nbytes / median_time(lambda: jax.block_until_ready(total(big)), 5)
    return rates, max(copy_bw, sum_bw)


def describe(rates: dict, bandwidth: float) -> str:
    return (f"{jax.devices()[0].platform}, matmul float32 {rates['float32'] / 1e9:.0f} / bfloat16 "
            f"{rates['bfloat16'] / 1e9:.0f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s (measured now)")
