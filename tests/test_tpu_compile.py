"""Deviceless TPU compilation (libtpu's compile-only devices, the `tpu` extra): every program of a
run compiles for a v5e 2x2 slice with a tiny model (the train step on tree rows with the Pallas
tree-attention kernel, the reference forward, the weight transfer, the sampler's prefill through
splash attention, extend, decode and fork; LoRA on plain rows through splash), and the compiled
train step keeps FSDP's sharding: parameters gathered one layer at a time inside the layer loop,
never all layers at once, and no chip holding the whole batch's activations."""
import re

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler here")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from steprl_jax.models.config import ModelConfig  # noqa: E402
from steprl_jax.models.transformer import Transformer  # noqa: E402
from steprl_jax.planning import targets  # noqa: E402
from steprl_jax.planning.programs import Setup, compile_run  # noqa: E402

B, T = 4, 256


@pytest.fixture(scope="module")
def compiled():
    config = ModelConfig.tiny("llama", num_layers=3, vocab_size=512)
    devices = targets.devices(targets.target("v5e-4"))
    keep = {}
    with jax.default_matmul_precision("default"):  # the suite's "highest" is refused by Mosaic for bf16
        plan = compile_run(Setup(model="tiny", batch=B, length=T, tree=True, decode_batch=4, context=T,
                                 attention="tpu", kl=True), devices, devices, config=config, keep=keep)
    return config, plan, keep


def _all_gathers(hlo: str):
    """(dtype, shape) of every all-gather's result in an HLO module's text."""
    found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found]


def test_every_program_compiles_with_the_fused_kernels(compiled):
    _, plan, keep = compiled
    programs = plan["programs"]
    assert set(programs) == {"train_step", "reference", "transfer", "prefill", "extend", "decode", "fork"}
    assert programs["train_step"]["fused_kernels"] >= 3  # the tree kernel's forward, dq and dk/dv
    hlo = keep["train_step"].as_text()
    assert all(name in hlo for name in ("tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"))
    assert programs["reference"]["fused_kernels"] >= 1 and programs["prefill"]["fused_kernels"] >= 1
    assert programs["train_step"]["temporaries"] > 0 and programs["decode"]["arguments"] > 0
    assert plan["attention"] == "tpu"


def test_lora_on_plain_rows_compiles_through_splash_attention():
    config = ModelConfig.tiny("gemma2", num_layers=2)  # sliding window and soft cap
    devices = targets.devices(targets.target("v5e-4"))
    with jax.default_matmul_precision("default"):
        plan = compile_run(Setup(model="tiny", batch=B, length=T, tree=False, lora_rank=4, attention="tpu"),
                           devices, devices, programs={"train_step"}, config=config)
    assert plan["programs"]["train_step"]["fused_kernels"] >= 2 and plan["trainable_parameters"] < 20_000


def test_fsdp_gathers_one_layer_at_a_time_and_no_chip_holds_the_whole_batch(compiled):
    config, _, keep = compiled
    program = keep["train_step"]
    hlo = program.as_text()
    stacked = {tuple(x.shape) for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))).layers))}
    gathers = _all_gathers(hlo)
    assert gathers, "an FSDP train step gathers its parameters"
    whole_layers = [g for g in gathers if g[1] in stacked]
    assert not whole_layers, f"all layers' parameters gathered at once: {whole_layers}"
    per_layer = {s[1:] for s in stacked}
    assert any(shape in per_layer or len(shape) and np.prod(shape) in {int(np.prod(p)) for p in per_layer}
               for _, shape in gathers), "no per-layer parameter gather found"
    D = config.hidden_size
    batch_activations = [g for g in gathers if g[0] in ("f32", "bf16") and np.prod(g[1]) >= B * T * D
                         and B in g[1] and T in g[1]]
    assert not batch_activations, f"the whole batch's activations gathered on a chip: {batch_activations}"
    tokens = program.input_shardings[0][1].tokens
    assert tokens.shard_shape((B, T)) == (1, T)  # one row per chip
