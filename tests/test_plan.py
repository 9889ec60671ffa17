"""The memory plan: a real preset's train step compiled ahead of time for a 4-device mesh (no
weights allocated); its per-device figures are consistent with the shapes, LoRA cuts the
optimizer state, and bad input names the flag."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(tmp_path, *args):
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "steprl_jax.plan", "--model", "llama-3.2-1b", "--mesh", "fsdp=4",
                          "--batch", "4", "--length", "64", "--json", str(out), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_plan_full_fine_tuning_and_lora(tmp_path):
    full, text = _plan(tmp_path, "--decode-batch", "8", "--context", "1024")
    assert full["parameters"] == 1_235_814_400 and full["devices"] == 4
    t = full["train_per_device"]
    # float32 master weights sharded 4 ways; Adam keeps two moments of the same size
    assert abs(t["parameters"] / (1_235_814_400 * 4 / 4) - 1) < 0.01
    assert abs(t["optimizer_state"] / (2 * t["parameters"]) - 1) < 0.01
    assert t["arguments"] >= t["parameters"] + t["optimizer_state"] and t["temporaries"] > 0
    assert t["peak"] >= t["arguments"]
    s = full["sampler_per_device"]
    assert s["kv_cache"] == 2 * 16 * 8 * 1024 * 8 * 64 * 2  # layers x rows x context x kv heads x head dim, bf16
    assert full["fits"]["h200"]["fits"] and "per device" in text
    lora, _ = _plan(tmp_path, "--lora-rank", "8")
    lt = lora["train_per_device"]
    assert lora["trainable_parameters"] < 0.02 * lora["parameters"]
    assert lt["optimizer_state"] < 0.05 * t["optimizer_state"]
    assert lt["peak"] < t["peak"]


def test_plan_refuses_a_bad_mesh_and_an_unknown_model(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "steprl_jax.plan", "--model", "llama-3.2-1b", "--mesh", "fsdp=x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "fsdp=x" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "steprl_jax.plan", "--model", "gpt-5", "--mesh", "fsdp=1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert unknown.returncode != 0 and "qwen2.5-7b" in unknown.stderr
