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


HLO = """\
%fused_computation.1 (param_0: bf16[8,16], param_1: bf16[16,4]) -> f32[8,4] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.2 (param_0.1: f32[8,4], param_1.1: f32[4,2]) -> (f32[8,4], f32[8,2]) {
  %param_0.1 = f32[8,4]{1,0} parameter(0)
  %param_1.1 = f32[4,2]{1,0} parameter(1)
  %dot.2 = f32[8,2]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple = (f32[8,4]{1,0}, f32[8,2]{1,0}) tuple(%param_0.1, %dot.2)
}

ENTRY %main (a: bf16[8,16], b: bf16[16,4], c: f32[4,2]) -> f32[8,2] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[16,4]{1,0} parameter(1)
  %c = f32[4,2]{1,0} parameter(2)
  %ynn_fusion = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.1
  %loop_fusion = (f32[8,4]{1,0}, f32[8,2]{1,0}) fusion(%ynn_fusion, %c), kind=kLoop, calls=%fused_computation.2
  ROOT %gte = f32[8,2]{1,0} get-tuple-element(%loop_fusion), index=1
}
"""


def test_matmul_ops_read_fusions_with_tuple_results_and_tell_bf16_from_f32():
    ops = xla_profile.matmul_ops(HLO)
    assert ops == {"ynn_fusion": (2 * 8 * 4 * 16, "bf16"), "loop_fusion": (2 * 8 * 2 * 4, "f32")}
    assert xla_profile.dot_flops_by_type(HLO, runs={"ynn_fusion": 3}) == {"bf16": 3 * 1024, "f32": 128}
