"""Mixed-precision einsum whose BACKWARD also runs as low-precision matmuls.

`jnp.einsum(eq, x.astype(bf16), w.astype(bf16), preferred_element_type=f32)` is fast forward,
but JAX's transpose rule multiplies the float32 cotangent with a bf16 operand, and XLA then
upcasts both to float32: the two backward matmuls (2/3 of a train step's FLOPs) run at the
float32 rate (~4x slower on this CPU). `mixed_einsum` casts the cotangent to the compute dtype
first, so all three matmuls are bf16-in / float32-accumulate; gradients come back in the
inputs' dtypes (float32 master weights stay float32).

Restricted to two-operand einsums written without `...`, where every index of an operand
appears in the other operand or in the output (true of every projection in a transformer).

`projection` is the same for the weight products of a layer (no index shared by the two
operands survives, so it is one 2-D matmul): in float32 its backward transposes the activation
explicitly for the weight gradient, `dW = x^T g`, and multiplies `dx = g W^T`. Left to itself,
XLA:CPU fuses the transpose it needs into the elementwise producer of `g` (silu's backward,
the sum of rope's cotangents) and writes that fusion column by column: 23 ms for a
[1024, 1536] float32 gradient in SmolLM2's MLP, where the explicit transpose of the narrower
activation costs ~1 ms. An MLP's forward + backward ran 1.6x faster in float32 and ~1.2x in
bf16 on a 2-core CPU. With bf16 operands the explicit transposes are not enough: XLA folds them
into the dots, then runs those dots in float32; both backward products are therefore written
as contractions over two halves (`_einsum_f32`; an odd summed size keeps the plain dot), which
stay bf16 (another ~1.5x on the MLP).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


@functools.lru_cache(maxsize=None)
def _parse(eq: str):
    if "..." in eq or "->" not in eq:
        raise ValueError(f"mixed_einsum needs an explicit 'ab,bc->ac' equation, got {eq!r}")
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        raise ValueError(f"mixed_einsum takes exactly two operands, got {eq!r}")
    x, w = parts
    for name, spec, others in (("first", x, w + out), ("second", w, x + out)):
        if len(set(spec)) != len(spec):
            raise ValueError(f"{eq!r}: repeated index in the {name} operand")
        lonely = [c for c in spec if c not in others]
        if lonely:
            raise ValueError(f"{eq!r}: index {lonely} of the {name} operand is summed alone")
    return x, w, out


def _einsum_f32(eq: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(eq, a, b)` accumulated in float32; a contraction over one index of even size
    that is not `a`'s last axis, or (low-precision operands) that is a 2-D `b`'s last axis, is
    written as a contraction over two halves of it (the same sum).

    Why: XLA:CPU sends a dot whose left operand is contracted over a non-minor axis (the weight
    gradient `x^T g` of a 2-D projection, attention's `P^T dO`) to a fallback that upcasts
    bf16 operands to float32 (2-3x slower), while a contraction over two axes is first
    canonicalised into a transposed copy that its fast bf16 kernel accepts. The same holds for
    `g W^T` (a projection's input gradient: the weight contracted over its minor axis) when
    `g` is computed in the program: in SmolLM2's train step those dots ran in float32 at
    ~190 GFLOP/s against ~450 for the bf16 ones, 5 of a 13 s step (profiled). Other backends
    get the einsum as written.
    """
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    contracted = [c for c in sa if c in sb and c not in out]
    rhs_minor = (len(contracted) == 1 and len(sb) == 2 and sb[-1] == contracted[0]
                 and a.dtype != jnp.float32)
    if (len(contracted) == 1 and (sa[-1] != contracted[0] or rhs_minor)
            and jax.default_backend() == "cpu"):
        c = contracted[0]
        n = a.shape[sa.index(c)]
        if n % 2 == 0:
            half = next(ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in eq)
            a = _split_axis(a, sa.index(c))
            b = _split_axis(b, sb.index(c))
            sa, sb = sa.replace(c, half + c), sb.replace(c, half + c)
            eq = f"{sa},{sb}->{out}"
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


def einsum_f32(eq: str, a: jax.Array, b: jax.Array, compute_dtype) -> jax.Array:
    """`einsum(eq, a, b)` of `compute_dtype` operands accumulated in float32, for code that
    writes its own backward pass (no custom VJP of its own)."""
    dt = jnp.dtype(compute_dtype)
    if dt == jnp.float32:
        return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)
    return _einsum_f32(eq, a.astype(dt), b.astype(dt))


def _split_axis(x: jax.Array, axis: int) -> jax.Array:
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1:])


def mixed_einsum(eq: str, x: jax.Array, w: jax.Array, compute_dtype=jnp.bfloat16) -> jax.Array:
    """float32 `einsum(eq, x, w)` with compute_dtype operands, forward and backward."""
    xs, ws, os_ = _parse(eq)
    dt = jnp.dtype(compute_dtype)

    @jax.custom_vjp
    def f(x, w):
        return jnp.einsum(eq, x.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)

    def fwd(x, w):
        x_c, w_c = x.astype(dt), w.astype(dt)
        return jnp.einsum(eq, x_c, w_c, preferred_element_type=jnp.float32), (x_c, w_c)

    def bwd(res, g):
        x_c, w_c = res
        g_c = g.astype(dt)
        dx = _einsum_f32(f"{os_},{ws}->{xs}", g_c, w_c)
        dw = _einsum_f32(f"{xs},{os_}->{ws}", x_c, g_c)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    f.defvjp(fwd, bwd)
    return f(x, w)


def projection(eq: str, x: jax.Array, w: jax.Array, compute_dtype=jnp.float32) -> jax.Array:
    """float32 `einsum(eq, x, w)` of an activation `x` and a weight `w` whose shared indices are
    all summed (e.g. "btd,dnh->btnh"), as one 2-D matmul with compute_dtype operands and
    float32 accumulation, forward and backward; gradients come back in the inputs' dtypes."""
    xs, ws, os_ = _parse(eq)
    summed = [c for c in ws if c in xs]
    if any(c in os_ for c in summed):
        raise ValueError(f"projection {eq!r}: an index of both operands is kept (a batch "
                         f"index); use mixed_einsum")
    x_free = [c for c in xs if c not in ws]
    w_free = [c for c in ws if c not in xs]
    size = dict(zip(xs, x.shape)) | dict(zip(ws, w.shape))
    count = lambda idx: math.prod(size[c] for c in idx)  # noqa: E731
    x_mk = jnp.transpose(x, [xs.index(c) for c in x_free + summed]).reshape(
        count(x_free), count(summed))
    w_kn = jnp.transpose(w, [ws.index(c) for c in summed + w_free]).reshape(
        count(summed), count(w_free))
    dtypes = (jnp.dtype(compute_dtype), x.dtype, w.dtype)
    y = _matmul_2d(x_mk, w_kn, dtypes).reshape([size[c] for c in x_free + w_free])
    return jnp.transpose(y, [(x_free + w_free).index(c) for c in os_])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_2d(x_mk, w_kn, dtypes):
    """x @ w with `dtypes = (compute, x's, w's)`: compute-dtype operands, float32 result;
    the gradients are accumulated in float32 and returned in x's and w's own dtypes."""
    compute = dtypes[0]
    return jnp.dot(x_mk.astype(compute), w_kn.astype(compute), preferred_element_type=jnp.float32)


def _matmul_2d_fwd(x_mk, w_kn, dtypes):
    x_c, w_c = x_mk.astype(dtypes[0]), w_kn.astype(dtypes[0])
    return jnp.dot(x_c, w_c, preferred_element_type=jnp.float32), (x_c, w_c)


def _matmul_2d_bwd(dtypes, res, g_mn):
    compute, x_dtype, w_dtype = dtypes
    x_c, w_c = res
    g_c = g_mn.astype(compute)
    if jnp.dtype(compute) == jnp.float32:
        dx = jnp.dot(g_c, jnp.transpose(w_c), preferred_element_type=jnp.float32)
        dw = jnp.dot(jnp.transpose(x_c), g_c, preferred_element_type=jnp.float32)
    else:
        # Written as `_einsum_f32` contractions, which XLA:CPU keeps in bf16 (a transposed
        # `x` or `W` folded into the dot made it upcast both to float32): SmolLM2's MLP
        # forward + backward 1.5x faster in bf16 on a 2-core CPU.
        dx = _einsum_f32("mn,kn->mk", g_c, w_c)
        dw = _einsum_f32("mk,mn->kn", x_c, g_c)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_matmul_2d.defvjp(_matmul_2d_fwd, _matmul_2d_bwd)
