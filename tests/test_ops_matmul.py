"""mixed_einsum: bf16 matmuls forward AND backward, gradients close to float32."""
import re

import jax
import jax.extend  # noqa: F401  (jaxprs_in_params)
import jax.numpy as jnp
import numpy as np
import pytest

from steprl_jax.ops.matmul import mixed_einsum


@pytest.mark.parametrize("eq,xs,ws", [("nd,vd->nv", (6, 8), (5, 8)),
                                      ("nd,vd->nv", (7, 8), (5, 8)),  # odd: no split
                                      ("bm,md->bd", (12, 8), (8, 6)),
                                      ("bkms,bksh->bkmh", (2, 3, 10, 6), (2, 3, 6, 4)),
                                      ("bkmh,bksh->bkms", (2, 3, 10, 4), (2, 3, 6, 4)),
                                      ("btd,dnh->btnh", (2, 3, 8), (8, 2, 4)),
                                      ("btnh,nhd->btd", (2, 3, 2, 4), (2, 4, 8))])
def test_values_and_grads_close_to_f32(eq, xs, ws):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(kx, xs), jax.random.normal(kw, ws)
    out = mixed_einsum(eq, x, w)
    ref = jnp.einsum(eq, x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)
    g = jax.random.normal(kg, ref.shape)
    dx, dw = jax.grad(lambda x, w: jnp.sum(mixed_einsum(eq, x, w) * g), (0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.einsum(eq, x, w) * g), (0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dx, rx, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(dw, rw, rtol=5e-2, atol=5e-2)


def test_backward_dots_are_bf16_only():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(mixed_einsum("bd,df->bf", x, w)),
                                    (0, 1)))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    dots += [e for eqn in jaxpr.jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(eqn.params)
             for e in sub.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for e in dots:
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a workaround for XLA:CPU only")
def test_weight_gradient_contracts_two_axes_not_one():
    """A 2-D projection's weight gradient `x^T g` sums over the rows as two halves: XLA:CPU
    then makes a bf16 transposed copy for its fast kernel instead of upcasting to float32."""
    x, w = jnp.ones((8, 4)), jnp.ones((4, 6))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(mixed_einsum("bd,df->bf", x, w)),
                                    (0, 1)))(x, w)
    weight_grads = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                    and e.outvars[0].aval.shape == (4, 6)]
    assert len(weight_grads) == 1
    (lhs_contract, _), _ = weight_grads[0].params["dimension_numbers"]
    assert len(lhs_contract) == 2


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def test_bad_equations():
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="explicit"):
        mixed_einsum("...d,vd->...v", x, x)
    with pytest.raises(ValueError, match="summed alone"):
        mixed_einsum("ab,cb->c", x, x)


@pytest.mark.parametrize("eq,xs,ws", [("btd,dnh->btnh", (2, 3, 8), (8, 2, 4)),
                                      ("bm,md->bd", (12, 8), (8, 6)),
                                      ("btf,fd->btd", (2, 5, 6), (6, 4)),
                                      ("nd,vd->nv", (6, 8), (5, 8)),        # weight transposed
                                      ("btnh,nhd->dbt", (2, 3, 2, 4), (2, 4, 8))])  # permuted out
def test_projection_values_and_grads(eq, xs, ws):
    from steprl_jax.ops.matmul import projection
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(1), 3)
    x, w = jax.random.normal(kx, xs), jax.random.normal(kw, ws)
    ref = jnp.einsum(eq, x, w)
    g = jax.random.normal(kg, ref.shape)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.einsum(eq, x, w) * g), (0, 1))(x, w)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)):
        out = projection(eq, x, w, dtype)
        assert out.dtype == jnp.float32 and out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        dx, dw = jax.grad(lambda x, w: jnp.sum(projection(eq, x, w, dtype) * g), (0, 1))(x, w)
        assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
        np.testing.assert_allclose(dx, rx, rtol=tol, atol=tol)
        np.testing.assert_allclose(dw, rw, rtol=tol, atol=tol)


def test_projection_weight_gradient_transposes_the_activation():
    """In float32, the weight gradient is a plain matmul of the explicitly transposed activation."""
    from steprl_jax.ops.matmul import projection
    x, w = jnp.ones((8, 4)), jnp.ones((4, 6))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(projection("bd,df->bf", x, w)),
                                    (0, 1)))(x, w)
    eqns = list(_all_eqns(jaxpr.jaxpr))
    (weight_grad,) = [e for e in eqns if e.primitive.name == "dot_general"
                      and e.outvars[0].aval.shape == (4, 6)]
    (lhs_contract, rhs_contract), _ = weight_grad.params["dimension_numbers"]
    assert tuple(lhs_contract) == (1,) and tuple(rhs_contract) == (0,)
    assert weight_grad.invars[0].aval.shape == (4, 8)  # x^T
    assert any(e.primitive.name == "transpose" and e.outvars[0] is weight_grad.invars[0]
               for e in eqns)


def test_projection_gradients_come_back_in_the_inputs_dtypes():
    from steprl_jax.ops.matmul import projection
    x = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones((8, 6), jnp.bfloat16)
    dx, dw = jax.grad(lambda x, w: jnp.sum(projection("bd,df->bf", x, w, jnp.bfloat16)),
                      (0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(dx, 6.0)
    np.testing.assert_allclose(dw.astype(jnp.float32), 4.0)


def test_projection_refuses_a_batch_index():
    from steprl_jax.ops.matmul import projection
    with pytest.raises(ValueError, match="batch index"):
        projection("bkm,bkn->bmn", jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)))


def _compiled_dot_operand_types(fn, *args):
    """The element types of both operands of every dot in `fn`'s optimised XLA program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    types = []
    for computation in text.split("\n\n"):
        shapes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", computation))
        for a, b in re.findall(r"= \w+\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", computation):
            types.append((shapes[a], shapes[b]))
    return types


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a workaround for XLA:CPU only")
def test_an_mlp_backward_runs_every_matmul_in_bf16_after_xla_optimises_it():
    """XLA:CPU upcast the input gradients `g W^T` (the weight contracted over its minor axis,
    `g` computed in the program) to float32 dots; summed as two halves they stay bf16."""
    from steprl_jax.ops.matmul import projection
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (2, 16, 32))
    w1, w2 = jax.random.normal(k2, (32, 64)), jax.random.normal(k3, (64, 32))

    def loss(x, w1, w2):
        h = jax.nn.silu(projection("btd,df->btf", x, w1, jnp.bfloat16))
        return jnp.sum(projection("btf,fd->btd", h, w2, jnp.bfloat16) ** 2)

    types = _compiled_dot_operand_types(jax.grad(loss, (0, 1, 2)), x, w1, w2)
    assert len(types) == 6, types  # 2 forward, 2 input gradients, 2 weight gradients
    assert all(t == ("bf16", "bf16") for t in types), types
