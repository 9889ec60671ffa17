"""Fused attention kernels for accelerators: which kernel a row gets, and its place on the mesh.

`ModelConfig.attention` names the implementation:

    "xla"            the portable path of `models.attention` (a [B, T, S] bias; CPU's choice)
    "tpu"            Pallas kernels compiled by Mosaic: splash attention (jax's, maintained
                     with it) for causal rows with packed segments and Gemma's sliding window;
                     `ops.tree_attention` for packed tree rows (branches see their ancestors)
    "tpu_interpret"  the same kernels in Pallas interpret mode: runs anywhere, slowly (tests)
    "gpu"            cuDNN's fused attention through `jax.nn.dot_product_attention` for
                     right-padded bf16 causal rows without segments or soft cap (the packer's
                     plain rows); tree rows, the sampler's left-padded chunks and the rest take
                     the portable path with a boolean mask (cuDNN takes no per-row mask)
    "auto"           "tpu" on TPU, "gpu" on GPU, "xla" elsewhere (the default device's platform)

Mosaic kernels are not partitioned by XLA (and XLA's cuDNN partitioner wants q, k and v sharded
alike), so on a mesh every kernel runs inside `shard_map`: the batch over the rules' batch axes,
the heads over "tensor" when both head counts divide. The mesh is
the one in context (`jax.sharding.use_abstract_mesh`, which the train step and the sampler set
while they trace); without one the kernel sees the whole array.

The kernels take the same [B, T] arrays as `models.attention.tree_mask` (`TreeRows`), never a
[B, T, S] mask; accelerators never get a float32 [B, T, S] bias (the cached path's masks stay
boolean). On TPU a row is padded to a multiple of 128 tokens (the lane width) for the kernel and
cut back after; tiles are the largest of 512 (splash) or 256 (trees), 256 and 128 that divide it.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from steprl_jax.models.sharding import LOGICAL_AXIS_RULES
from steprl_jax.ops.tree_attention import TreeRows, tree_attention

LANE = 128
# Kernel tiles: 512 queries x 512 keys for splash (its published defaults on v5e/v5p are
# 512-1024); 256 x 256 for trees, finer so that sibling branches leave whole tiles hidden.
# (A row's padded length picks the largest of these, then 256 and 128, that divides it.)
SPLASH_BLOCK = 512
TREE_BLOCK = 256


def resolve(name: str) -> str:
    """The implementation `name` stands for ("auto": from the default device's platform)."""
    if name != "auto":
        return name
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), "xla")


def takes(impl: str, tree: bool, segments: bool, softcap: Optional[float], dtype: str,
          right_padded: bool = True) -> bool:
    """Whether `impl` has a fused kernel for a full-sequence row of this kind: TPU for every
    row; GPU for right-padded causal rows (the packer's; not the sampler's left-padded chunks)
    without segments or a soft cap, in bf16 (cuDNN's case)."""
    if impl in ("tpu", "tpu_interpret"):
        return True
    if impl == "gpu":
        return not tree and not segments and softcap is None and right_padded and dtype == "bfloat16"
    return False


def _block(length: int, sizes: tuple) -> int:
    """The largest of `sizes` that divides `length` (a multiple of 128), else `length`."""
    return next((b for b in sizes if length % b == 0), length)


def attend(q_btnh, k_btkh, v_btkh, rows: TreeRows, *, impl: str, tree: bool, window: Optional[int],
           scale: float, softcap: Optional[float]):
    """Causal self-attention of a full row under `rows`' mask with a fused kernel; returns
    [B, T, N, H] in the queries' dtype. `tree`: the row holds branches (`rows.node`, `rows.end`);
    `window`: Gemma's sliding window for this layer (None: global)."""
    q = (q_btnh * scale).astype(q_btnh.dtype)
    head_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    if impl == "gpu":
        kernel = functools.partial(_cudnn, window=window)
        return head_major(_on_mesh(kernel, head_major(q), head_major(k_btkh), head_major(v_btkh), rows))
    interpret = impl == "tpu_interpret"
    kernel = (functools.partial(_tree, softcap=softcap, window=window, interpret=interpret) if tree
              else functools.partial(_splash, softcap=softcap, window=window, interpret=interpret))
    T = q.shape[1]
    pad = -T % LANE
    if pad:  # padding tokens: invalid, so no real token sees them
        widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
        q, k_btkh, v_btkh = widen(q), widen(k_btkh), widen(v_btkh)
        rows = TreeRows(*(widen(x) for x in rows))
    out = _on_mesh(kernel, head_major(q), head_major(k_btkh), head_major(v_btkh), rows)
    return head_major(out)[:, :T]


def _cudnn(q_bnth, k_bksh, v_bksh, rows: TreeRows, *, window):
    """cuDNN's fused attention (grouped-query heads as they are); right-padded rows: a real
    token never sees the padding after it. Per device (XLA's cuDNN partitioner wants q, k and v
    sharded alike, which the layer's activations need not be)."""
    del rows
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.nn.dot_product_attention(t(q_bnth), t(k_bksh), t(v_bksh), scale=1.0, is_causal=True,
                                       implementation="cudnn", local_window_size=(window - 1, 0) if window else None)
    return t(out)


def _tree(q, k, v, rows, *, softcap, window, interpret):
    block = _block(q.shape[2], (TREE_BLOCK, LANE))
    return tree_attention(q, k, v, rows, softcap=softcap, window=window, block_q=block, block_k=block,
                          interpret=interpret)


def _splash(q_bnth, k_bksh, v_bksh, rows: TreeRows, *, softcap, window, interpret):
    """Splash attention, grouped-query: the MQA kernel over each kv head's G query heads.
    Padding is a segment of its own (-1): it sees only padding, and no real token sees it."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, N, T, H = q_bnth.shape
    K = k_bksh.shape[1]
    G = N // K
    mask = (masks.LocalMask((T, T), window_size=(window - 1, 0), offset=0) if window
            else masks.CausalMask((T, T)))
    block = _block(T, (SPLASH_BLOCK, 256, LANE))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mqa_single_device(masks.MultiHeadMask([mask] * G), block_sizes=sizes,
                                                  attn_logits_soft_cap=softcap, interpret=interpret)
    segments = jnp.where(rows.valid, rows.segment, -1).astype(jnp.int32)
    one_head = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s))  # noqa: E731
    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))  # over kv heads
    if (not interpret and q_bnth.dtype != jnp.float32
            and str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32")):
        # its backward is traced where no `with` of ours reaches, so say it rather than fail in Mosaic
        raise ValueError("splash attention: Mosaic refuses bf16 products at the 'highest' matmul precision "
                         "(jax_default_matmul_precision); leave it unset, or set model.attention=xla")
    out = jax.vmap(per_row)(q_bnth.reshape(B, K, G, T, H), k_bksh, v_bksh, segments)
    return out.reshape(B, N, T, H)


def _on_mesh(kernel, q_bnth, k_bksh, v_bksh, rows: TreeRows):
    """`kernel` per device under the mesh in context: rows over the batch axes, heads over
    "tensor" where both head counts divide it; the whole arrays without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q_bnth, k_bksh, v_bksh, rows)
    B, N = q_bnth.shape[:2]
    K = k_bksh.shape[1]
    batch = _axes(mesh, LOGICAL_AXIS_RULES["batch"], B)
    heads = _axes(mesh, LOGICAL_AXIS_RULES["heads"], np.gcd(N, K))
    heads_spec = PartitionSpec(batch, heads)
    rows_spec = TreeRows(*[PartitionSpec(batch)] * len(TreeRows._fields))
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads_spec, heads_spec, heads_spec, rows_spec),
                         out_specs=heads_spec, check_vma=False)(q_bnth, k_bksh, v_bksh, rows)


def _axes(mesh, rule, size: int):
    """The mesh axes of a logical rule that `size` divides evenly (None: replicated)."""
    names = (rule,) if isinstance(rule, str) else tuple(rule or ())
    names = tuple(a for a in names if a in mesh.shape and mesh.shape[a] > 1)
    if not names or size % int(np.prod([mesh.shape[a] for a in names])):
        return None
    return names if len(names) > 1 else names[0]


def traced_under(mesh, fn):
    """`fn`, traced with `mesh` in context (the kernels' `shard_map` reads it there); `fn`
    itself without a mesh. Wrap the function given to `jax.jit`."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def in_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return in_mesh
