"""Roofline estimates of a plan's programs, per chip, from the model's shapes: an estimate.

XLA's cost analysis counts a loop's body once (the layers run under `lax.scan`, decoding under a
while loop), so its flops are far below what a step does; here each program's work is counted
from the architecture instead, and its time is max(flops / peak bf16 rate, bytes / HBM bandwidth)
on the chip's published figures (`targets.py`):

  train step  forward, backward (two matmul passes: activations and weights; one with LoRA,
              whose frozen weights need no gradient) and under remat the forward again, each
              2 x matmul parameters x tokens; attention 4 x layers x heads x head dim x T^2 / 2
              per pass and row (the causal half; tree rows skip more, so this is an upper bound);
              bytes: the layer weights gathered for each pass (bf16) and the optimizer's update
              (the state read and written)
  reference   one forward pass
  prefill     one forward pass of the chunk over the host's chips; extend adds the chunk's
              attention over every cache slot
  decode      per token: every weight and the cache read once (memory-bound), times the chunk
  fork        the cache read and written; transfer: the float32 weights moved
"""
from __future__ import annotations


def matmul_parameters(cfg) -> int:
    """Parameters used as matmul operands (the unembedding once)."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.vocab_size * cfg.hidden_size


def _attention_flops(cfg, rows: float, queries: int, keys: float) -> float:
    """One pass's attention products (scores and values) for `rows` rows."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * queries * keys


def program_costs(result: dict, cfg, chips: int, host_chips: int) -> dict:
    """{program: (flops, bytes)} per chip, for the programs `result` compiled."""
    s = result["setup"]
    n = matmul_parameters(cfg)
    rows_chip = result["batch"] / chips
    T = s["length"]
    passes = 1 + (1 if s.get("lora_rank") else 2) + (1 if s["remat"] else 0)
    trained = result["train_resident"]["trainable"] + result["train_resident"]["optimizer_state"]
    out = {}
    forward = lambda rows: 2 * n * rows * T + _attention_flops(cfg, rows, T, T / 2)  # noqa: E731
    if "train_step" in result["programs"]:
        out["train_step"] = (passes * forward(rows_chip), passes * 2 * n + 3 * trained)
    if "reference" in result["programs"]:
        out["reference"] = (forward(rows_chip), 2 * n)
    sampler = result.get("sampler_resident")
    if sampler:
        B, S = result["sampler_rows_per_host"], s["context"]
        weights, cache = sampler["weights"], sampler["kv_cache"]
        for name in ("prefill", "extend"):
            p = result["programs"].get(name)
            if p:
                chunk = p.get("tokens", s["prefill_chunk"])
                keys = chunk / 2 if name == "prefill" else S
                flops = (2 * n * B * chunk + _attention_flops(cfg, B, chunk, keys)) / host_chips
                out[name] = (flops, weights + cache)
        if "decode" in result["programs"]:
            steps = s["decode_chunk"]
            out["decode"] = (steps * (2 * n * B + _attention_flops(cfg, B, 1, S)) / host_chips,
                             steps * (weights + cache))
        if "fork" in result["programs"]:
            out["fork"] = (0.0, 2 * cache)
        if "transfer" in result["programs"]:
            out["transfer"] = (0.0, 2 * 4 * (n + cfg.vocab_size * cfg.hidden_size) / chips)
    return out


def estimate(result: dict, cfg, chip, chips: int, host_chips: int) -> None:
    """Add `model_flops`, `model_bytes` and `roofline_seconds` (estimates) to each program."""
    if not chip.bf16_flops:
        return
    for name, (flops, nbytes) in program_costs(result, cfg, chips, host_chips).items():
        fig = result["programs"][name]
        fig["model_flops"], fig["model_bytes"] = float(flops), float(nbytes)
        fig["roofline_seconds"] = max(flops / chip.bf16_flops, nbytes / chip.hbm_bandwidth)
