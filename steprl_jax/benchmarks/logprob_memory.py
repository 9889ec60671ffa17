"""Peak memory of per-token log-probs, forward + backward: chunked vs naive [B, T, V] path.

    python -m steprl_jax.benchmarks.logprob_memory [--batch 8 --length 2048 --vocab 49152]

Both programs compute d/d(hidden, unembed) of sum(logp * g) (g a fixed cotangent), the
pattern of a policy-gradient step. Memory comes from XLA's compiled-program analysis
(arguments + outputs + temporaries, the buffer assignment's peak), measured in the same run
for both paths; nothing needs to execute, so the naive path's multi-GiB buffers are never
allocated. Target: chunked <= 25% of naive.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from steprl_jax.ops.logprobs import naive_token_logprobs, token_logprobs


def compiled_bytes(fn, *args) -> dict:
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    args_b, out_b, temp_b = (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                             mem.temp_size_in_bytes)
    return {"arguments": args_b, "outputs": out_b, "temporaries": temp_b,
            "peak": args_b + out_b + temp_b - getattr(mem, "alias_size_in_bytes", 0)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--chunk", type=int, default=128)
    a = p.parse_args(argv)
    b, t, v, d = a.batch, a.length, a.vocab, a.hidden
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    y = jax.ShapeDtypeStruct((b, t), jnp.int32)
    g = jax.ShapeDtypeStruct((b, t), jnp.float32)

    def grad_of(logp_fn):
        def f(h, w, y, g):
            return jax.grad(lambda h, w: jnp.sum(logp_fn(h, w, y) * g), (0, 1))(h, w)
        return f

    chunked = compiled_bytes(grad_of(lambda h, w, y: token_logprobs(h, w, y,
                                                                   chunk_size=a.chunk)),
                             h, w, y, g)
    naive = compiled_bytes(grad_of(naive_token_logprobs), h, w, y, g)
    gib = lambda x: x / 2**30
    print(f"log-prob forward+backward, B={b} T={t} V={v} D={d}, chunk={a.chunk} positions")
    print(f"(full [B,T,V] float32 logits = {gib(4 * b * t * v):.2f} GiB)")
    print(f"{'path':<10}{'arguments':>12}{'outputs':>12}{'temporaries':>14}{'peak':>12}  (GiB)")
    for name, m in (("naive", naive), ("chunked", chunked)):
        print(f"{name:<10}{gib(m['arguments']):>12.3f}{gib(m['outputs']):>12.3f}"
              f"{gib(m['temporaries']):>14.3f}{gib(m['peak']):>12.3f}")
    ratio = chunked["peak"] / naive["peak"]
    print(f"chunked / naive peak = {ratio:.1%}  (target <= 25%: {'PASS' if ratio <= .25 else 'FAIL'})")
    return ratio


if __name__ == "__main__":
    main()
