"""The plan: a real preset's programs compiled ahead of time for 4 devices (no weights
allocated); per-device figures consistent with the shapes, LoRA cuts the optimizer state, the
target table maps cloud names to topologies, and bad input names the flag."""
import json
import os
import subprocess
import sys

import pytest

from steprl_jax.planning.targets import target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(tmp_path, *args):
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "steprl_jax.plan", "--target", "cpu-4", "--model", "llama-3.2-1b",
                          "--batch", "4", "--length", "64", "--json", str(out), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_plan_full_fine_tuning_and_lora(tmp_path):
    full, text = _plan(tmp_path, "--decode-batch", "8", "--context", "1024", "--programs", "train_step,fork")
    assert full["parameters"] == 1_235_814_400 and full["devices"] == 4
    res, step = full["train_resident"], full["programs"]["train_step"]
    # float32 master weights sharded 4 ways; Adam keeps two moments of the same size
    assert abs(res["parameters"] / (1_235_814_400 * 4 / 4) - 1) < 0.01
    assert abs(res["optimizer_state"] / (2 * res["parameters"]) - 1) < 0.01
    assert step["arguments"] >= res["parameters"] + res["optimizer_state"] and step["temporaries"] > 0
    assert step["peak"] >= step["arguments"]
    # layers x 2 (k, v) x rows x context x kv heads x head dim, bf16, kv heads split over the sampler's tensor=4
    assert full["sampler_resident"]["kv_cache"] == 16 * 2 * 8 * 1024 * 8 * 64 * 2 // 4 + 8 * 1024 * 4
    assert full["phases"]["peak"] >= step["peak"] and "XLA:CPU stand-in" in text
    lora, _ = _plan(tmp_path, "--lora-rank", "8", "--programs", "train_step")
    lres = lora["train_resident"]
    assert lora["trainable_parameters"] < 0.02 * lora["parameters"]
    assert lres["optimizer_state"] < 0.05 * res["optimizer_state"]
    assert lora["programs"]["train_step"]["peak"] < step["peak"]


def test_plan_a_sampler_whose_rows_share_a_prompt_prefix(tmp_path):
    """--shared-prefix: the prefix is held once per host (its kv heads split like the rows'), each
    row holds the rest of the context; the decode program compiles over both."""
    plan, _ = _plan(tmp_path, "--decode-batch", "8", "--context", "1024", "--shared-prefix", "512",
                    "--programs", "decode")
    rows = 16 * 2 * 8 * 512 * 8 * 64 * 2 // 4 + 8 * 512 * 4  # 512 own slots a row
    segment = 16 * 2 * 512 * 8 * 64 * 2 // 4 + 512 * 4  # one copy: layers x (k, v) x slots x kv heads x dim
    assert plan["sampler_resident"]["kv_cache"] == rows + segment
    assert plan["programs"]["decode"]["peak"] > 0


def test_cloud_names_map_to_topologies():
    assert (target("v5e-8").topology, target("v5e-8").chips, target("v5e-8").hosts) == ("v5e:2x4", 8, 1)
    assert (target("v5litepod-16").topology, target("v5litepod-16").hosts) == ("v5e:4x4", 4)
    assert (target("v5p-16").topology, target("v5p-16").chips) == ("v5p:2x2x2", 8)  # v5p counts TensorCores
    assert target("v6e-8").topology == "v6e:2x4" and target("v4-8").topology == "v4:2x2x1"
    for bad, says in (("v5p-5", "per chip"), ("v5p-12", "power of two"), ("v7x-8", "unknown accelerator"), ("v5e-12", "power of two")):
        with pytest.raises(ValueError, match=says):
            target(bad)


def test_plan_refuses_a_bad_mesh_an_unknown_model_and_a_bad_target(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "steprl_jax.plan", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    bad = run("--model", "llama-3.2-1b", "--mesh", "fsdp=x")
    assert bad.returncode == 2 and "fsdp=x" in bad.stderr
    unknown = run("--model", "gpt-5")
    assert unknown.returncode == 2 and "qwen2.5-7b" in unknown.stderr
    wrong = run("--model", "llama-3.2-1b", "--target", "tpu9-8")
    assert wrong.returncode == 2 and "tpu9" in wrong.stderr
    preset = run("--preset", "portool-gpt")
    assert preset.returncode == 2 and "portool-qwen2.5-7b" in preset.stderr


def test_phases_add_up_what_each_phase_holds():
    from steprl_jax.planning.programs import phases

    G = 1 << 30
    program = lambda peak, temps, outs=0, donated=0: dict(peak=peak, temporaries=temps, outputs=outs,  # noqa: E731
                                                          donated=donated)
    result = {"setup": {"lora_rank": 0},
              "train_resident": {"parameters": 2 * G, "trainable": 2 * G, "optimizer_state": 4 * G},
              "sampler_resident": {"weights": 1 * G, "kv_cache": 3 * G},
              "programs": {"train_step": program(10 * G, 3 * G), "reference": program(3 * G, 1 * G),
                           "transfer": program(3 * G, 1 * G, 1 * G), "decode": program(4 * G, 2 * G),
                           "fork": program(6 * G, 0, 3 * G)}}
    got = phases(result)
    # a KL term with full fine-tuning keeps a frozen copy (2 GiB) resident beside the trainer (6 GiB)
    assert got["train"] == 1 * G + 10 * G + 2 * G
    assert got["reference"] == 8 * G + 1 * G + 3 * G - 2 * G
    assert got["rollout"] == 8 * G + 1 * G + 3 * G + 3 * G  # the fork's new cache beside the old one
    assert got["transfer"] == 8 * G + 1 * G + 2 * G
    assert got["peak"] == max(v for k, v in got.items() if k != "peak")


def test_the_roofline_counts_every_layer_of_a_step():
    """The estimate counts the model's work (XLA's cost analysis counts a scanned body once): a
    train step without remat is three passes of 2 x matmul parameters x tokens plus attention."""
    from steprl_jax.models.presets import preset
    from steprl_jax.planning import roofline
    from steprl_jax.planning.targets import CHIPS

    cfg = preset("llama-3.2-1b")
    n = roofline.matmul_parameters(cfg)
    assert n == 16 * (2048 * 64 * (2 * 32 + 2 * 8) + 3 * 2048 * 8192) + 128256 * 2048
    result = {"setup": {"length": 1024, "remat": None}, "batch": 8,
              "train_resident": {"trainable": 4 * n, "optimizer_state": 8 * n},
              "programs": {"train_step": {}}}
    roofline.estimate(result, cfg, CHIPS["v5p"], chips=4, host_chips=4)
    step = result["programs"]["train_step"]
    attention = 4 * 16 * 32 * 64 * 2 * 1024 * 512
    assert step["model_flops"] == 3 * (2 * n * 2 * 1024 + attention)
    assert step["roofline_seconds"] == max(step["model_flops"] / 459e12, step["model_bytes"] / 2765e9)
