"""Peak host memory while loading a ~1B-parameter checkpoint, relative to the parameters' size.

    python -m steprl_jax.benchmarks.load_memory [--dir DIR] [--keep]

Writes a randomly initialised Llama-3.2-1B-shaped Hugging Face checkpoint
(bfloat16 safetensors, two shards + index, built with numpy one tensor at a
time) to a temporary directory, then loads it with `load_pretrained` in a fresh
subprocess per target dtype and reads the process's peak resident set size
(VmHWM). Printed: peak, parameter bytes in the target dtype, and their ratio
(the target is < 1.5x). The ratio counts everything in the process, the Python
and JAX runtime included (shown separately as "baseline").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_act": "silu", "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}


def _shapes(c: dict) -> list[tuple[str, tuple]]:
    D, F, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    H, N, K = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, D)), ("model.norm.weight", (D,))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (D,)), (p + "post_attention_layernorm.weight", (D,)),
                (p + "self_attn.q_proj.weight", (N * H, D)), (p + "self_attn.k_proj.weight", (K * H, D)),
                (p + "self_attn.v_proj.weight", (K * H, D)), (p + "self_attn.o_proj.weight", (D, N * H)),
                (p + "mlp.gate_proj.weight", (F, D)), (p + "mlp.up_proj.weight", (F, D)),
                (p + "mlp.down_proj.weight", (D, F))]
    return out


def write_checkpoint(directory: str, seed: int = 0) -> int:
    """Write the random checkpoint; returns the number of parameters."""
    from steprl_jax.models.safetensors_io import LazyTensors, write_safetensors

    rng = np.random.default_rng(seed)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = _shapes(CONFIG)

    def make(name):
        shape = dict(shapes)[name]
        if name.endswith("norm.weight"):
            return np.ones(shape, bf16)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(bf16)

    half = len(shapes) // 2
    weight_map = {}
    for k, part in enumerate((shapes[:half], shapes[half:])):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        write_safetensors(os.path.join(directory, shard), LazyTensors([(n, s, bf16) for n, s in part], make))
        weight_map.update({n: shard for n, _ in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return int(sum(np.prod(s) for _, s in shapes))


_CHILD = r"""
import json, sys
def hwm():
    status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    return int(status["VmHWM"].split()[0]) * 1024, int(status["VmRSS"].split()[0]) * 1024
import jax, jax.numpy as jnp
from steprl_jax.models import load_pretrained
jnp.zeros(1).block_until_ready()  # start the runtime before measuring the baseline
baseline = hwm()[0]
model, _ = load_pretrained(sys.argv[1], dtype=sys.argv[2])
leaves = jax.tree.leaves(model)
jax.block_until_ready(leaves)
param_bytes = sum(x.size * x.dtype.itemsize for x in leaves if hasattr(x, "dtype"))
peak, rss = hwm()
print(json.dumps({"baseline": baseline, "peak": peak, "rss": rss, "param_bytes": param_bytes}))
"""


def measure(directory: str, dtype: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one host device, as on a real load
    out = subprocess.run([sys.executable, "-c", _CHILD, directory, dtype], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"loading subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args(argv)
    directory = args.dir or tempfile.mkdtemp(prefix="steprl_load_memory_")
    os.makedirs(directory, exist_ok=True)
    try:
        n = write_checkpoint(directory)
        on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"checkpoint: Llama-3.2-1B shape, {n / 1e9:.3f}B parameters, bf16 safetensors, "
              f"{on_disk / 2**30:.2f} GiB on disk, 2 shards")
        print(f"{'target dtype':>12} | {'params GiB':>10} | {'baseline GiB':>12} | {'peak GiB':>8} | "
              f"{'peak / params':>13} | {'(peak - baseline) / params':>26}")
        for dtype in args.dtypes.split(","):
            r = measure(directory, dtype)
            gib = 2 ** 30
            print(f"{dtype:>12} | {r['param_bytes'] / gib:10.2f} | {r['baseline'] / gib:12.2f} | "
                  f"{r['peak'] / gib:8.2f} | {r['peak'] / r['param_bytes']:12.2f}x | "
                  f"{(r['peak'] - r['baseline']) / r['param_bytes']:25.2f}x")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
