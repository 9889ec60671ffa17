"""benchmarks.xla_profile: matmul FLOPs by operand type from the compiled program, op times
from a real profiler trace."""
import jax
import jax.numpy as jnp

from steprl_jax.benchmarks import xla_profile


def _step(a, b, c):
    bf16 = jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    f32 = jnp.dot(jnp.tanh(bf16), c)
    return jnp.sum(f32 * 2.0)


def test_dot_flops_by_operand_type_come_from_the_compiled_program():
    a, b, c = jnp.ones((64, 128)), jnp.ones((128, 96)), jnp.ones((96, 32))
    text = jax.jit(_step).lower(a, b, c).compile().as_text()
    flops = xla_profile.dot_flops_by_type(text)
    assert sum(flops.values()) == 2 * 64 * 128 * 96 + 2 * 64 * 96 * 32
    assert flops.get("f32", 0) >= 2 * 64 * 96 * 32  # the float32 product stays float32


def test_a_traced_call_times_every_matmul_and_the_other_ops(tmp_path):
    a, b, c = jnp.ones((256, 512)), jnp.ones((512, 384)), jnp.ones((384, 128))
    step = jax.jit(_step)
    jax.block_until_ready(step(a, b, c))
    rows, wall = xla_profile.profile_call(step, a, b, c, trace_dir=str(tmp_path))
    assert wall > 0
    matmul = [r for r in rows if r[0].startswith("matmul")]
    assert sum(r[3] for r in matmul) == 2 * 256 * 512 * 384 + 2 * 256 * 384 * 128
    assert all(r[1] > 0 and r[2] >= 1 for r in rows)
    table = xla_profile.format_rows(rows, wall, matmul_rate=1e11)
    assert "| matmul" in table and "in XLA ops" in table
