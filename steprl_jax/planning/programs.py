"""Every program a run compiles, built from shapes alone and compiled ahead of time.

`compile_run(setup, devices)` lowers and compiles, with abstract arrays (no weights), the
programs of one online iteration at the run's shapes:

    train_step   the learner's update on `batch` packed rows of `length` tokens (tree rows:
                 branches see their ancestors), full fine-tuning or LoRA
    reference    the frozen reference's log-prob forward (when the run has a KL term)
    transfer     trainer -> sampler: the reshard that gives every host a whole copy of the
                 weights split over its own chips (`training.distributed.SamplerBridge`)
    prefill      the sampler's first prompt chunk into an empty KV cache (fused attention)
    extend       a later chunk, or a tool's output, appended: attends over every cache slot
    decode       the sampler's decode loop (`generate`), one chunk of new tokens
    fork         a tree's fork: cache rows gathered (`Sampler.fork`)

and reads from each compiled program XLA's memory analysis (per device: arguments, outputs,
aliased/donated buffers, temporaries) and cost analysis (flops, bytes accessed). The trainer runs
on every chip of the slice; the sampler on one host's chips (it holds a full copy per host).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import NamedTuple, Optional

import numpy as np

AXES = ("data", "fsdp", "tensor")
PROGRAMS = ("train_step", "reference", "transfer", "prefill", "extend", "decode", "fork")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run's shapes. `mesh` / `sampler_mesh`: axis sizes (missing axes 1; fsdp 0: the rest)."""

    model: str
    batch: int = 0  # packed rows per train step (all micro-batches); 0: one per chip
    length: int = 4096  # tokens per row
    tree: bool = True  # rows hold branches (PORTool trees, SWiRL's G actions, GRPO groups)
    lora_rank: int = 0
    microbatches: int = 1
    max_microbatch_tokens: int = 0
    remat: str = "qkvo_saveable"
    dtype: str = "bfloat16"
    attention: str = "auto"
    kl: bool = False
    mesh: tuple = (("fsdp", 0),)
    sampler_mesh: tuple = ()  # over one host's chips; (): tensor over the kv heads it divides, fsdp the rest
    decode_batch: int = 0  # rows sampled at once over the slice, each host its share (0: no sampler)
    context: int = 0
    prefill_chunk: int = 512
    decode_chunk: int = 256
    shared_prefix: int = 0  # prompt tokens every row shares (system prompt, tools), held once (`SharedKV`)


def mesh_sizes(spec: tuple, devices: int) -> dict:
    """{"data": d, "fsdp": f, "tensor": t} for `devices`, the one axis given as 0 taking the rest."""
    sizes = {**dict.fromkeys(AXES, 1), **dict(spec)}
    fill = [a for a, v in sizes.items() if v == 0]
    fixed = int(np.prod([v for v in sizes.values() if v]))
    if len(fill) > 1 or devices % fixed:
        raise ValueError(f"mesh {dict(spec)} does not fit {devices} devices")
    for a in fill:
        sizes[a] = devices // fixed
    if int(np.prod(list(sizes.values()))) != devices:
        raise ValueError(f"mesh {sizes} needs {int(np.prod(list(sizes.values())))} devices; there are {devices}")
    return sizes


def _mesh(devices, sizes: dict):
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices, dtype=object).reshape([sizes[a] for a in AXES]), AXES)


def _figures(compiled, seconds: float) -> dict:
    if isinstance(compiled, OutOfMemory):  # what the compiler said; the rest is unknown
        return {"arguments": 0, "outputs": 0, "donated": 0, "temporaries": compiled.temporaries,
                "peak": compiled.temporaries, "flops": 0.0, "bytes_accessed": 0.0, "fused_kernels": 0,
                "compile_seconds": round(seconds, 1), "out_of_memory": compiled.message}
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "donated": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
           "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
           "compile_seconds": round(seconds, 1), "cost_analysis": bool(cost)}
    out["peak"] = out["arguments"] + out["outputs"] - out["donated"] + out["temporaries"]
    text = compiled.as_text() or ""
    out["fused_kernels"] = text.count("tpu_custom_call") + text.count("__cudnn$fmha")
    return out


class OutOfMemory(NamedTuple):
    """A program the compiler refused: its temporaries alone exceed the chip's memory."""

    message: str
    temporaries: int


def _compile(jitted, *args, keep=None, **kwargs) -> tuple:
    import jax

    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        found = re.search(r"temporaries \(([\d.]+)([KMGT])", str(e))
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
        size = int(float(found.group(1)) * scale[found.group(2)]) if found else 0
        return OutOfMemory(str(e).splitlines()[0][:300], size), time.perf_counter() - start
    if keep is not None:
        keep[0][keep[1]] = compiled
    return compiled, time.perf_counter() - start


def _bytes_per_device(values, shardings) -> int:
    import jax

    total = 0
    for x, s in zip(jax.tree.leaves(values), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def _unwrap(tree):
    import jax
    from flax import nnx

    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    return jax.tree.map(lambda v: v.get_value() if is_var(v) else v, tree, is_leaf=is_var)


def _with_shardings(values, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), values, shardings)


def compile_run(setup: Setup, devices, host_devices, *, programs: Optional[set] = None, config=None,
                keep: Optional[dict] = None) -> dict:
    """Compile `setup`'s programs: the trainer on `devices`, the sampler on `host_devices` (one
    host's). Returns shapes, per-program figures and the per-device phases (see `phases`).
    `config`: a ModelConfig instead of the preset `setup.model` names; `keep`: filled with the
    compiled programs by name (to read their HLO)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from steprl_jax.models import lora
    from steprl_jax.models.presets import preset
    from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, batch_sharding
    from steprl_jax.models.transformer import Transformer
    from steprl_jax.training import LossConfig, TrainStepConfig, make_train_step
    from steprl_jax.training.batch import Batch
    from steprl_jax.training.state import TrainState, split_model, train_state_shardings
    from steprl_jax.training.step import make_logprob_fn

    wanted = programs or set(PROGRAMS)
    sizes = mesh_sizes(setup.mesh, len(devices))
    mesh = _mesh(devices, sizes)
    cfg = (config or preset(setup.model)).replace(compute_dtype=setup.dtype, attention=setup.attention)
    keep = {} if keep is None else keep

    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        return lora.add_adapters(model, lora.LoraConfig(rank=setup.lora_rank)) if setup.lora_rank else model

    abstract = nnx.eval_shape(build)
    graphdef, params, rest = split_model(abstract)  # with LoRA: params = the adapters, rest = the base
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
    tx = optax.adamw(1e-6)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest,
                       opt_state=jax.eval_shape(tx.init, params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    shardings = train_state_shardings(state, mesh, LOGICAL_AXIS_RULES)
    count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))  # noqa: E731
    result = {"setup": dataclasses.asdict(setup), "mesh": sizes, "devices": len(devices),
              "parameters": count(nnx.state(abstract, lora.Frozen)) if setup.lora_rank else count(params),
              "trainable_parameters": count(params), "attention": cfg.attention, "programs": {}}
    trainable = _bytes_per_device(_unwrap(state.params), _unwrap(shardings.params))
    resident = {"parameters": trainable + _bytes_per_device(_unwrap(state.rest), _unwrap(shardings.rest)),
                "trainable": trainable,
                "optimizer_state": _bytes_per_device(_unwrap(state.opt_state), _unwrap(shardings.opt_state))}
    result["train_resident"] = resident
    B, L = setup.batch or len(devices), setup.length
    result["batch"] = B
    row = lambda dt: jax.ShapeDtypeStruct((B, L), dt)  # noqa: E731
    tree = dict(positions=row(jnp.int32), branch_ids=row(jnp.int32), branch_ends=row(jnp.int32)) if setup.tree else {}
    rows = Batch(tokens=row(jnp.int32), loss_mask=row(jnp.float32), advantages=row(jnp.float32),
                 old_logp=row(jnp.float32), attention_mask=row(jnp.int32), **tree)
    figures = result["programs"]
    if "train_step" in wanted:
        step = make_train_step(graphdef, tx, TrainStepConfig(
            loss=LossConfig(kind="policy", agg="token_mean"), num_microbatches=setup.microbatches,
            remat=setup.remat or None, max_microbatch_tokens=setup.max_microbatch_tokens),
            mesh=mesh, state_shardings=shardings)
        figures["train_step"] = _figures(*_compile(step, state, rows, keep=(keep, "train_step")))
    if setup.kl and "reference" in wanted:
        ref_fn = make_logprob_fn(graphdef, mesh=mesh)
        on_batch = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(mesh))  # noqa: E731
        frozen = _with_shardings(_unwrap(state.params), _unwrap(shardings.params))
        base = _with_shardings(_unwrap(state.rest), _unwrap(shardings.rest))
        figures["reference"] = _figures(*_compile(
            ref_fn, frozen, base, on_batch(rows.tokens), on_batch(rows.attention_mask), on_batch(rows.loss_mask),
            *[on_batch(tree[k]) if tree else None for k in ("positions", "branch_ids", "branch_ends")]))
    if setup.decode_batch and setup.context:
        result.update(_sampler_programs(setup, cfg, mesh, devices, host_devices, wanted, figures, keep))
    result["phases"] = phases(result)
    return result


def _sampler_programs(setup, cfg, mesh, devices, host_devices, wanted, figures, keep) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from steprl_jax.models import fused_attention
    from steprl_jax.models.sharding import LOGICAL_AXIS_RULES, state_shardings
    from steprl_jax.models.transformer import KVCache, SharedKV, Transformer
    from steprl_jax.sampling import sampler as sampler_lib
    from steprl_jax.sampling.params import DecodeProgram, ExtendProgram
    from steprl_jax.shapes import bucket
    from steprl_jax.training.distributed import host_split_spec

    groups = {}  # the devices of each host (process)
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    host = _mesh(host_devices, mesh_sizes(setup.sampler_mesh or _sampler_mesh(cfg, len(host_devices)),
                                          len(host_devices)))
    # The sampler's model: plain weights (LoRA merged), matmul weights in the compute dtype.
    graphdef, sstate = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    full = _unwrap(sstate)
    dtype = jnp.dtype(setup.dtype)
    values = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, dtype if sampler_lib.is_matmul_weight(p) else x.dtype), full)
    target = _unwrap(state_shardings(sstate, host, LOGICAL_AXIS_RULES))
    out = {"sampler_mesh": dict(host.shape), "sampler_resident": {"weights": _bytes_per_device(values, target)}}

    if "transfer" in wanted:
        # One reshard over every device: each host ends with a whole copy split over its chips.
        n = min(len(g) for g in groups.values())
        stacked = Mesh(np.asarray([g[:n] for g in groups.values()], dtype=object), ("process", "local"))
        src = _with_shardings(full, _unwrap(state_shardings(sstate, mesh, LOGICAL_AXIS_RULES)))
        dst = jax.tree.map(lambda x: NamedSharding(stacked, host_split_spec(x.shape, n)), full)
        figures["transfer"] = _figures(*_compile(jax.jit(lambda x: x, out_shardings=dst), src))

    shard = sampler_lib.cache_shardings(host, LOGICAL_AXIS_RULES, cfg.num_kv_heads)
    constrain = functools.partial(sampler_lib.constrain_cache, shard)
    dp = sampler_lib.data_parallel(host, LOGICAL_AXIS_RULES)
    B = -(-setup.decode_batch // (len(groups) * dp)) * dp  # this host's rows
    P = bucket(setup.shared_prefix, 16) if setup.shared_prefix else 0  # the shared segment's slots
    S = setup.context - setup.shared_prefix  # each row's own slots: what follows the shared prefix
    if S < 1:
        raise ValueError(f"--shared-prefix {setup.shared_prefix} leaves no slots of the context {setup.context}")
    out["sampler_rows_per_host"] = B
    cache = jax.eval_shape(lambda: KVCache.init(cfg, B, S, dtype))
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
    cache = KVCache(tuple(sds(x, shard[2]) for x in cache.k), tuple(sds(x, shard[2]) for x in cache.v),
                    sds(cache.slot_pos, shard[1]), jax.ShapeDtypeStruct((), jnp.int32, sharding=shard[3]),
                    jax.ShapeDtypeStruct((B,), jnp.bool_, sharding=shard[0]) if P else None)
    shared, segment = None, []
    if P:  # one copy per host, its kv heads split as the rows' are
        heads = NamedSharding(host, PartitionSpec(*shard[2].spec[1:]))
        kv = jax.ShapeDtypeStruct((cfg.num_kv_heads, P, cfg.head_dim), dtype, sharding=heads)
        shared = SharedKV((kv,) * cfg.num_layers, (kv,) * cfg.num_layers,
                          jax.ShapeDtypeStruct((P,), jnp.int32, sharding=NamedSharding(host, PartitionSpec())))
        segment = [*shared.k, *shared.v, shared.pos]
    out["sampler_resident"]["kv_cache"] = _bytes_per_device(
        [*cache.k, *cache.v, cache.slot_pos, *segment],
        [*[shard[2]] * (2 * len(cache.k)), shard[1], *[x.sharding for x in segment]])
    params = _with_shardings(values, target)
    unstack = jax.jit(lambda s: nnx.merge(graphdef, s).layers.unstacked()).lower(params).compile()
    layer_params = jax.tree.map(sds, jax.eval_shape(lambda s: nnx.merge(graphdef, s).layers.unstacked(), params),
                                unstack.output_shardings)
    replicated = NamedSharding(host, PartitionSpec())
    params = {**params, "layers": jax.tree.map(  # the sampler keeps the unstacked copy only
        lambda x: jax.ShapeDtypeStruct((0,), x.dtype, sharding=replicated), params["layers"])}
    rows = lambda dt: jax.ShapeDtypeStruct((B,), dt, sharding=shard[0])  # noqa: E731
    # The sampler's chunks (Sampler._chunks, its default byte budget): a fresh cache's first chunk
    # through the fused kernel when there is one, later chunks (and tool outputs) over every slot.
    chunk = min(S, bucket(sampler_lib.extend_chunk(setup.prefill_chunk, 1 << 30, 16, B, cfg.num_heads, S + P), 16))
    fused_first = not P and fused_attention.takes(cfg.attention, False, False, cfg.attn_logit_softcap,
                                                  cfg.compute_dtype, right_padded=False)
    extend, decode, take = sampler_lib.jitted_programs(graphdef, host, constrain)
    for name, T, fresh in (("prefill", min(setup.prefill_chunk, S) if fused_first else chunk, fused_first),
                           ("extend", chunk, False)):
        if name in wanted:
            ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=shard[1])
            figures[name] = _figures(*_compile(extend, params, layer_params, cache, ids, ids, shared,
                                               program=ExtendProgram(B, T, S, fresh=fresh, shared=P)))
            figures[name]["tokens"] = T
    if "decode" in wanted:
        program = DecodeProgram(batch=B, cache_length=S, max_new=setup.decode_chunk, greedy=False, top_k=0,
                                top_p=False, with_entropy=False, stop_ids=tuple(cfg.eos_token_ids) or (0,),
                                stop_states=0, max_context=setup.context, shared=P)
        unembed = jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), dtype, sharding=replicated)
        scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=shard[3])  # noqa: E731
        keys = jax.ShapeDtypeStruct((B, 2), jnp.uint32, sharding=shard[1])
        figures["decode"] = _figures(*_compile(
            decode, params, layer_params, unembed, cache, rows(jnp.int32), rows(jnp.int32), rows(jnp.int32), keys,
            rows(jnp.int32), rows(jnp.int32), scalar(jnp.int32), scalar(jnp.bool_), scalar(jnp.float32),
            scalar(jnp.float32), jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.int32, sharding=replicated),
            shared, program=program, keep=(keep, "decode")))
    if "fork" in wanted:
        figures["fork"] = _figures(*_compile(take, rows(jnp.int32), cache, rows(jnp.int32)))
    return out


def _sampler_mesh(cfg, chips: int) -> tuple:
    """Tensor parallel over as many chips as divide the kv heads (each keeps its heads' cache),
    the rows split over the rest."""
    tensor = int(np.gcd(cfg.num_kv_heads, chips))
    return (("fsdp", chips // tensor), ("tensor", tensor))


def phases(result: dict) -> dict:
    """Per-device bytes in each phase of an iteration, and the peak. The trainer's state and the
    sampler's weights stay resident; the KV cache lives while rolling out; each program adds its
    temporaries (and outputs not written over its donated inputs) while it runs."""
    p = result["programs"]
    resident = result["train_resident"]
    trainer = resident["parameters"] + resident["optimizer_state"]
    full_reference = "reference" in p and not result["setup"]["lora_rank"]
    if full_reference:  # full fine-tuning with a KL term keeps a frozen copy of the start beside it
        trainer += resident["trainable"]
    sampler = result.get("sampler_resident", {})
    weights, cache = sampler.get("weights", 0), sampler.get("kv_cache", 0)
    extra = lambda name: (p[name]["temporaries"] + max(p[name]["outputs"] - p[name]["donated"], 0)  # noqa: E731
                          if name in p else 0)
    out = {}
    if "train_step" in p:  # its arguments are the trainer's state and the batch
        out["train"] = weights + p["train_step"]["peak"] + (resident["trainable"] if full_reference else 0)
    if "reference" in p:  # its arguments: the frozen copy (counted in `trainer`) or the trainer's own base (LoRA)
        out["reference"] = trainer + weights + p["reference"]["peak"] - resident["parameters"]
    if weights:
        out["rollout"] = trainer + weights + cache + max(extra(n) for n in ("prefill", "extend", "decode", "fork"))
        out["transfer"] = trainer + weights + extra("transfer")
    out["peak"] = max(out.values())
    refused = [name for name, f in p.items() if "out_of_memory" in f]
    if refused:
        out["refused_by_compiler"] = refused
    return out
