"""Will it fit? Every program of a run compiled for the target's chips, before the run.

    python -m steprl_jax.plan --target v5p-16 --model qwen2.5-7b --batch 8 --length 8192 \\
        [--lora-rank 16] [--decode-batch 64 --context 8192] [--kl] [--json PATH]
    python -m steprl_jax.plan --target v5e-8 --preset portool-qwen2.5-7b-lora
    python -m steprl_jax.plan --target cpu-4 --model llama-3.2-1b --batch 4 --length 64

With libtpu installed (`pip install -e ".[tpu]"`, works on any Linux host) a TPU target compiles
on libtpu's compile-only devices: the real TPU compiler, Pallas/Mosaic kernels included, and the
figures are that compiler's (per chip). With the CUDA plugin (`pip install -e ".[gpu]"`, also
without a GPU) `h100-N` / `h200-N` (N <= 8, one host) compile with XLA:GPU the same way
(`planning/gpu.py` says what that does not check). `cpu-N` compiles on N virtual CPU devices, a stand-in
whose figures are the order of magnitude only (XLA:CPU fuses differently and runs the "xla"
attention path). Programs: see `planning/programs.py`. The roofline time of each program is an
estimate, labelled as one: max(flops / peak bf16 rate, bytes / HBM bandwidth) per chip, the work
counted from the architecture (`planning/roofline.py`: XLA's cost analysis, kept in the JSON,
counts a loop's body once) on the chip's published figures (`planning/targets.py`).
"""
from __future__ import annotations

import argparse
import os
import sys

GIB = 1 << 30


def _devices(target):
    """(all devices, one host's devices) for the target."""
    import jax

    from steprl_jax.planning import targets

    if target.platform == "tpu":
        devs = targets.devices(target)
        return devs, devs if target.hosts == 1 else targets.devices(target.one_host())
    if target.platform == "gpu":
        devs = targets.devices(target)
        return devs, devs
    devs = jax.devices()[: target.chips]
    if len(devs) < target.chips:
        raise ValueError(f"--target {target.name}: {target.chips} devices needed, this process has {len(devs)}")
    return devs, devs[: min(len(devs), 8)]


def plan(target_name: str, setup, programs: set = frozenset()) -> dict:
    """Compile `setup` (planning.programs.Setup) for the target; the plan as a dict."""
    import dataclasses

    from steprl_jax.planning import targets
    from steprl_jax.planning.programs import compile_run

    target = targets.target(target_name)
    if target.platform in ("tpu", "gpu"):
        if target.platform == "tpu":
            why = targets.libtpu_available()
        else:
            from steprl_jax.planning import gpu

            why = gpu.why_not()
        if why:
            raise ValueError(f"--target {target_name}: {why}; or use --target cpu-{target.chips}")
        if setup.attention == "auto":
            setup = dataclasses.replace(setup, attention=target.platform)
    elif setup.attention == "auto":
        setup = dataclasses.replace(setup, attention="xla")
    devices, host = _devices(target)
    result = compile_run(setup, devices, host, programs=set(programs) or None)
    chip = target.chip
    result["target"] = {"name": target.name, "chip": chip.kind, "chips": target.chips, "hosts": target.hosts,
                        "topology": target.topology or (f"{target.chips} compile-only GPU(s)" if target.platform == "gpu"
                                                        else f"{target.chips} virtual CPU devices"),
                        "compiler": {"tpu": "TPU (libtpu, compile-only devices)",
                                     "gpu": "XLA:GPU (CUDA plugin, compile-only devices; autotuning off, "
                                            "cuDNN workspace not counted)"}.get(
                            target.platform, "XLA:CPU stand-in (order of magnitude only)"),
                        "hbm_per_chip": chip.hbm}
    from steprl_jax.models.presets import preset
    from steprl_jax.planning import roofline

    roofline.estimate(result, preset(setup.model), chip, target.chips, len(host))
    peak = result["phases"]["peak"]
    result["fits"] = bool(chip.hbm and peak <= chip.hbm and not result["phases"].get("refused_by_compiler"))
    result["used"] = round(peak / chip.hbm, 3) if chip.hbm else None
    return result


def smallest_slice(chip: str, setup, programs: set = frozenset(), most_chips: int = 256) -> dict:
    """The plan on the smallest slice of `chip` (a TPU or GPU kind) the run fits, from its
    compiler: slices tried from the smallest that can hold the trainer's state upwards (`tried`
    lists each); GPUs up to one host of 8."""
    from steprl_jax.models.presets import count_params, preset
    from steprl_jax.planning import targets

    kind = targets.target(chip + "-8").chip
    if not kind.hbm:
        raise ValueError(f"--target {chip}: give the device count (cpu-N); only accelerators are searched")
    if targets.target(chip + "-8").platform == "gpu":
        most_chips = min(most_chips, 8)  # GPU plans cover one host
    n = count_params(preset(setup.model))
    state = n * (4 if setup.lora_rank else 12)  # float32 weights (+ Adam's two moments when all are trained)
    chips = 4 if kind.dims == 3 else 1  # v4/v5p slices start at 4 chips; v5e/v6e and GPUs at 1
    while chips * kind.hbm < state and chips < most_chips:
        chips *= 2
    tried = []
    while chips <= most_chips:
        name = f"{chip}-{chips * kind.cores_per_name}"
        result = plan(name, setup, programs)
        tried.append({"target": name, "peak": result["phases"]["peak"], "fits": result["fits"]})
        print(f"  {name}: {result['phases']['peak'] / GIB:.1f} GiB per chip: "
              f"{'fits' if result['fits'] else 'does not fit'}", flush=True)
        if result["fits"]:
            result["tried"] = tried
            return result
        if len(tried) >= 3 and tried[-1]["peak"] > 0.95 * tried[-2]["peak"] > 0.95 ** 2 * tried[-3]["peak"]:
            raise ValueError(f"the run fits no {chip} slice: its per-chip memory stopped falling with more chips "
                             f"(what every chip holds whole: rows, sampler weights per host): {tried}")
        chips *= 2
    raise ValueError(f"the run fits no {chip} slice up to {most_chips} chips: {tried}")


def _print(r: dict) -> None:
    g = lambda b: f"{b / GIB:7.2f} GiB"  # noqa: E731
    s, t = r["setup"], r["target"]
    print(f"{s['model']}: {r['parameters'] / 1e9:.2f}B parameters"
          + (f" + LoRA rank {s['lora_rank']} ({r['trainable_parameters'] / 1e6:.1f}M trained)" if s["lora_rank"]
             else " (full fine-tuning)")
          + f"; {r['batch']} {'tree' if s['tree'] else 'plain'} rows x {s['length']} tokens, {s['dtype']}, "
          f"attention {r['attention']}")
    print(f"target {t['name']}: {t['chips']} x {t['chip']} ({t['topology']}, {t['hosts']} host(s)); "
          f"compiled by {t['compiler']}; trainer mesh {r['mesh']}"
          + (f", sampler mesh {r['sampler_mesh']} per host, {r['sampler_rows_per_host']} rows each"
             if "sampler_mesh" in r else ""))
    print(f"  {'program':<11}{'compile':>9}{'arguments':>13}{'temporaries':>13}{'peak':>13}"
          f"{'TFLOP':>9}{'GB moved':>10}{'roofline (estimate)':>21}")
    for name, f in r["programs"].items():
        roof = f"{f['roofline_seconds'] * 1e3:10.1f} ms" if "roofline_seconds" in f else ""
        cost = (f"{f['model_flops'] / 1e12:>9.2f}{f['model_bytes'] / 1e9:>10.2f}" if "model_flops" in f
                else f"{'n/a':>9}{'n/a':>10}")
        print(f"  {name:<11}{f['compile_seconds']:>8.1f}s{g(f['arguments']):>13}{g(f['temporaries']):>13}"
              f"{g(f['peak']):>13}{cost}{roof:>21}")
    res = r["train_resident"]
    print(f"  resident: trainer parameters {g(res['parameters'])}, optimizer state {g(res['optimizer_state'])}"
          + "".join(f", sampler {k} {g(v)}" for k, v in r.get("sampler_resident", {}).items()))
    print("  per chip by phase: " + ", ".join(f"{k} {g(v).strip()}" for k, v in r["phases"].items()
                                               if k != "refused_by_compiler"))
    for name, f in r["programs"].items():
        if "out_of_memory" in f:
            print(f"  {name}: the compiler refused it: {f['out_of_memory']}")
    flags = ["--config.mesh.fsdp=-1"]  # the run's own defaults differ (one device samples): say what was assumed
    flags += [f"--config.mesh.sampler.{a}={n}" for a, n in r.get("sampler_mesh", {}).items() if n > 1]
    if s["remat"] != "qkvo_saveable":
        flags.append(f"--config.rl.remat={s['remat'] or 'none'} (SWiRL: --config.swirl.train.remat)")
    print("  run it as planned with " + " ".join(flags))
    hbm = t["hbm_per_chip"]
    if hbm:
        print(f"  {t['chip']} has {hbm / GIB:.0f} GiB per chip: "
              f"{'fits' if r['fits'] else 'does NOT fit'} ({r['used']:.0%})")


def _sizes(text: str, flag: str) -> tuple:
    from steprl_jax.planning.programs import AXES

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit():
            raise ValueError(f"{flag}: {part!r} is not AXIS=N with AXIS in {AXES} (N = 0: the devices left)")
        out.append((name, int(value)))
    return tuple(out)


def parse(argv=None):
    from steprl_jax.planning import presets

    p = argparse.ArgumentParser(prog="python -m steprl_jax.plan", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="cpu-8", help="v5e-8, v5litepod-16, v5p-16, v6e-8, v4-8, ... or cpu-N; "
                                                     "h100-N, h200-N (N <= 8); a chip alone (v5e, v5p, h100, ...): the smallest slice "
                                                     "the run fits")
    p.add_argument("--preset", default="", help=f"a paper's set-up: {', '.join(presets.PRESETS)}")
    p.add_argument("--model", default="", help="a model preset (steprl_jax.models.presets)")
    p.add_argument("--mesh", default="", help="trainer mesh, e.g. fsdp=0 (0: every device left), data=2,fsdp=0")
    p.add_argument("--batch", type=int, help="packed rows per train step (default: one per chip)")
    p.add_argument("--length", type=int, help="tokens per row")
    p.add_argument("--rows", choices=("tree", "plain"), help="tree rows (branches) or plain causal rows")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype")
    p.add_argument("--attention", choices=("auto", "xla", "tpu", "gpu"), help="auto: the target's fused kernels")
    p.add_argument("--remat", help="rematerialisation policy ('' for none)")
    p.add_argument("--microbatches", type=int)
    p.add_argument("--max-microbatch-tokens", type=int)
    p.add_argument("--decode-batch", type=int, help="rows sampled at once over the slice, each host its share "
                                                    "(0: no sampler programs)")
    p.add_argument("--context", type=int, help="sampler context (cache slots)")
    p.add_argument("--shared-prefix", type=int, help="prompt tokens all rows share (system prompt, tool list), "
                                                     "held once beside the rows")
    p.add_argument("--sampler-mesh", default="", help="the sampler's mesh over one host's chips, e.g. tensor=4,fsdp=0 "
                                                     "(default: tensor over the kv heads it divides, fsdp the rest)")
    p.add_argument("--lora-rank", type=int, help="train LoRA adapters of this rank (0: every weight)")
    p.add_argument("--kl", action="store_true", default=None, help="the run has a KL term: compile the reference")
    p.add_argument("--programs", default="", help="compile only these, e.g. train_step,decode (default: all)")
    p.add_argument("--json", default="", help="write the plan here")
    args = p.parse_args(argv)
    from steprl_jax.planning.programs import PROGRAMS as known

    args.programs = set(filter(None, args.programs.split(",")))
    if args.programs - set(known):
        p.error(f"--programs: {', '.join(sorted(args.programs - set(known)))} not among {', '.join(known)}")
    if not args.preset and not args.model:
        p.error("give --model or --preset")
    try:
        base = presets.preset(args.preset) if args.preset else presets.Setup(model=args.model)
        changes = {k: v for k, v in dict(
            model=args.model or None, batch=args.batch, length=args.length,
            tree=None if args.rows is None else args.rows == "tree", dtype=args.dtype, attention=args.attention,
            remat=args.remat, microbatches=args.microbatches, max_microbatch_tokens=args.max_microbatch_tokens,
            decode_batch=args.decode_batch, context=args.context, shared_prefix=args.shared_prefix, lora_rank=args.lora_rank, kl=args.kl,
            mesh=_sizes(args.mesh, "--mesh") if args.mesh else None,
            sampler_mesh=_sizes(args.sampler_mesh, "--sampler-mesh") if args.sampler_mesh else None).items()
            if v is not None}
        import dataclasses

        from steprl_jax.planning import targets

        target = targets.target(args.target if "-" in args.target else args.target + "-8")
        setup = dataclasses.replace(base, **changes)
    except (ValueError, KeyError) as e:
        p.error(str(e).strip("'\""))
    return args, setup, target


def main(argv=None) -> int:
    args, setup, target = parse(argv)
    if "jax" not in sys.modules and target.platform == "cpu":
        # virtual CPU devices stand in for the chips (set before JAX starts)
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={target.chips}"])
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing; libtpu / the CUDA plugin compile
    from steprl_jax.models.presets import HF_CONFIGS  # JAX starts here, after the flags above

    if setup.model not in HF_CONFIGS:
        print(f"error: --model: unknown preset {setup.model!r}; presets: {', '.join(sorted(HF_CONFIGS))}",
              file=sys.stderr)
        return 2
    try:
        if "-" in args.target:
            result = plan(args.target, setup, args.programs)
        else:
            result = smallest_slice(args.target, setup, args.programs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print(result)
    if args.json:
        from steprl_jax.io import write_json_atomic

        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
