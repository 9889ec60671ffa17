"""Will it fit? A memory plan before the run, from XLA's own analysis of the compiled step.

    python -m steprl_jax.plan --model qwen2.5-7b --mesh fsdp=16,tensor=1 --batch 16 --length 4096 \\
        [--dtype bfloat16] [--remat qkvo_saveable] [--microbatches 1] [--max-microbatch-tokens N] \\
        [--decode-batch 64 --context 8192 --sampler-mesh tensor=4] [--lora-rank 16] [--json PATH]

Builds the train state with the preset's real shapes and no weights (abstract arrays), places it
on a mesh of that many devices by the rules table, lowers and compiles the train step ahead of
time (on this machine: virtual CPU devices stand in for the chips) and reads the per-device bytes
from XLA's memory analysis: arguments (parameters, optimizer state, batch), outputs, donated
buffers and temporaries (activations kept for the backward pass, gradients, logits chunks). The
sampler's share (its copy of the weights in the compute dtype and the KV cache of `decode-batch`
rows of `context` tokens, over the sampler's own mesh on one host) is added from shapes. The
verdict compares the sum with each chip's memory.

CPU compilation is a stand-in: XLA's TPU and GPU compilers fuse differently, so read the figures as
the order of magnitude (typically within tens of percent), not to the last megabyte.
"""
from __future__ import annotations

import argparse
import os
import sys

GIB = 1 << 30
CHIPS = {"v5e": 16 * GIB, "v5p": 95 * GIB, "h100": 80 * GIB, "h200": 141 * GIB}
AXES = ("data", "fsdp", "tensor")


def parse_mesh(text: str) -> dict:
    """"fsdp=16,tensor=1" -> {"data": 1, "fsdp": 16, "tensor": 1}."""
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: {part!r} is not AXIS=N with AXIS in {AXES} and N >= 1")
        sizes[name] = int(value)
    return sizes


def _bytes_per_device(tree, shardings) -> int:
    import jax
    import numpy as np

    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        total += int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
    return total


def plan(model: str, mesh_sizes: dict, batch: int, length: int, *, dtype: str = "bfloat16",
         remat: str = "qkvo_saveable", microbatches: int = 1, max_microbatch_tokens: int = 0, decode_batch: int = 0, context: int = 0,
         sampler_mesh: dict | None = None, lora_rank: int = 0) -> dict:
    """The plan as a dict (see the module docstring); needs prod(mesh) devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    from steprl_jax.models import lora
    from steprl_jax.models.presets import preset
    from steprl_jax.models.sharding import LOGICAL_AXIS_RULES
    from steprl_jax.models.transformer import Transformer
    from steprl_jax.training import LossConfig, TrainStepConfig, make_train_step
    from steprl_jax.training.batch import Batch
    from steprl_jax.training.state import TrainState, split_model, train_state_shardings

    n = int(np.prod(list(mesh_sizes.values())))
    if jax.device_count() < n:
        raise ValueError(f"the mesh {mesh_sizes} needs {n} devices; this process has {jax.device_count()}")
    mesh = Mesh(np.asarray(jax.devices()[:n]).reshape([mesh_sizes[a] for a in AXES]), AXES)
    cfg = preset(model, compute_dtype=dtype)
    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        return lora.add_adapters(model, lora.LoraConfig(rank=lora_rank)) if lora_rank else model

    abstract = nnx.eval_shape(build)
    graphdef, params, rest = split_model(abstract)  # with LoRA: params = the adapters, rest = the base
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
    tx = optax.adamw(1e-6)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest,
                       opt_state=jax.eval_shape(tx.init, params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    shardings = train_state_shardings(state, mesh, LOGICAL_AXIS_RULES)
    count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
    trainable_count = count(params)
    base_count = count(nnx.state(abstract, lora.Frozen)) if lora_rank else trainable_count
    step = make_train_step(graphdef, tx, TrainStepConfig(loss=LossConfig(kind="policy", agg="token_mean"),
                                                         num_microbatches=microbatches, remat=remat or None,
                                                         max_microbatch_tokens=max_microbatch_tokens),
                           mesh=mesh, state_shardings=shardings)
    bt = lambda dt: jax.ShapeDtypeStruct((batch, length), dt)
    rows = Batch(tokens=bt(jnp.int32), loss_mask=bt(jnp.float32), advantages=bt(jnp.float32),
                 old_logp=bt(jnp.float32), attention_mask=bt(jnp.int32))
    compiled = step.lower(state, rows).compile()
    memory = compiled.memory_analysis()
    unwrap = lambda t: jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, t,
                                    is_leaf=lambda v: isinstance(v, nnx.Variable))
    param_bytes = _bytes_per_device(unwrap(state.params), unwrap(shardings.params))
    opt_bytes = _bytes_per_device(unwrap(state.opt_state), unwrap(shardings.opt_state))
    frozen_bytes = _bytes_per_device(unwrap(state.rest), unwrap(shardings.rest))
    train = {"arguments": int(memory.argument_size_in_bytes), "outputs": int(memory.output_size_in_bytes),
             "donated": int(memory.alias_size_in_bytes), "temporaries": int(memory.temp_size_in_bytes),
             "parameters": param_bytes + frozen_bytes, "trainable": param_bytes, "optimizer_state": opt_bytes}
    train["peak"] = train["arguments"] + train["outputs"] - train["donated"] + train["temporaries"]

    sampler = {}
    if decode_batch and context:
        s = {**dict.fromkeys(AXES, 1), **(sampler_mesh or {})}
        itemsize = jnp.dtype(dtype).itemsize
        weights = base_count * itemsize
        kv = 2 * cfg.num_layers * decode_batch * context * cfg.num_kv_heads * cfg.head_dim * itemsize
        kv_split = s["data"] * s["fsdp"] * (s["tensor"] if cfg.num_kv_heads % s["tensor"] == 0 else 1)
        sampler = {"weights": weights // s["tensor"], "kv_cache": kv // kv_split, "mesh": s}
    total = train["peak"] + sampler.get("weights", 0) + sampler.get("kv_cache", 0)
    return {"model": model, "parameters": base_count, "trainable_parameters": trainable_count, "lora_rank": lora_rank,
            "mesh": mesh_sizes, "devices": n, "batch": batch, "length": length, "dtype": dtype, "remat": remat,
            "microbatches": microbatches,
            "max_microbatch_tokens": max_microbatch_tokens, "train_per_device": train, "sampler_per_device": sampler,
            "total_per_device": total,
            "fits": {chip: {"hbm": hbm, "fits": total <= hbm, "used": round(total / hbm, 3)}
                     for chip, hbm in CHIPS.items()},
            "backend": jax.default_backend()}


def _print(result: dict) -> None:
    g = lambda b: f"{b / GIB:8.2f} GiB"
    print(f"{result['model']}: {result['parameters'] / 1e9:.2f}B parameters"
          + (f" + LoRA rank {result['lora_rank']} ({result['trainable_parameters'] / 1e6:.1f}M trained)"
             if result["lora_rank"] else "") + f"; mesh {result['mesh']} "
          f"({result['devices']} devices, compiled on {result['backend']}); batch {result['batch']} x "
          f"{result['length']} tokens, {result['dtype']}, remat {result['remat']}")
    t = result["train_per_device"]
    print("train step, per device:")
    for key in ("parameters", "trainable", "optimizer_state", "arguments", "outputs", "donated", "temporaries",
                "peak"):
        print(f"  {key:<16}{g(t[key])}")
    s = result["sampler_per_device"]
    if s:
        print(f"sampler, per device (mesh {s['mesh']}):")
        print(f"  {'weights':<16}{g(s['weights'])}\n  {'kv_cache':<16}{g(s['kv_cache'])}")
    print(f"total per device: {g(result['total_per_device'])}")
    for chip, v in result["fits"].items():
        print(f"  {chip:<6}{v['hbm'] / GIB:5.0f} GiB: {'fits' if v['fits'] else 'does NOT fit'} ({v['used']:.0%})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m steprl_jax.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a preset (steprl_jax.models.presets)")
    p.add_argument("--mesh", default="fsdp=8", help="trainer mesh, e.g. fsdp=16,tensor=1")
    p.add_argument("--batch", type=int, default=8, help="packed rows per train step")
    p.add_argument("--length", type=int, default=4096, help="tokens per row")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
    p.add_argument("--remat", default="qkvo_saveable", help="rematerialisation policy ('' for none)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--max-microbatch-tokens", type=int, default=0,
                   help="padded tokens per micro-batch and data shard (0: exactly --microbatches)")
    p.add_argument("--decode-batch", type=int, default=0, help="sampler rows (0: no sampler)")
    p.add_argument("--context", type=int, default=0, help="sampler context length")
    p.add_argument("--sampler-mesh", default="", help="sampler mesh over one host's devices, e.g. tensor=4")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    p.add_argument("--json", default="", help="write the plan here")
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    sampler_mesh = parse_mesh(args.sampler_mesh) if args.sampler_mesh else None
    n = 1
    for v in mesh.values():
        n *= v
    if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        # virtual CPU devices stand in for the chips (set before JAX starts)
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    result = plan(args.model, mesh, args.batch, args.length, dtype=args.dtype, remat=args.remat,
                  microbatches=args.microbatches,
                  max_microbatch_tokens=args.max_microbatch_tokens, decode_batch=args.decode_batch, context=args.context,
                  sampler_mesh=sampler_mesh, lora_rank=args.lora_rank)
    _print(result)
    if args.json:
        from steprl_jax.evaluation.metrics import write_json_atomic

        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
