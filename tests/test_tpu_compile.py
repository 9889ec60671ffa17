"""Deviceless TPU compilation (libtpu's compile-only devices, the `tpu` extra): a tiny model's
train step on tree rows (the Pallas tree-attention kernel) and its decode chunk compile for a
v5e 2x2 slice, and the compiled train step keeps FSDP's sharding: parameters gathered one layer
at a time inside the layer loop, never all layers at once, and no chip holding the whole batch's
activations."""
import re

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[tpu]'): no TPU compiler here")

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
    plan = compile_run(Setup(model="tiny", batch=B, length=T, tree=True, decode_batch=4, context=T, attention="tpu"),
                       devices, devices, programs={"train_step", "decode"}, config=config, keep=keep)
    return config, plan, keep


def _all_gathers(hlo: str):
    """(dtype, shape) of every all-gather's result in an HLO module's text."""
    found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", hlo)
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found]


def test_train_step_and_decode_compile_with_the_fused_kernels(compiled):
    _, plan, _ = compiled
    train, decode = plan["programs"]["train_step"], plan["programs"]["decode"]
    assert train["fused_kernels"] >= 3  # the tree kernel's forward, dq and dk/dv
    assert train["temporaries"] > 0 and decode["arguments"] > 0
    assert plan["attention"] == "tpu"


def test_fsdp_gathers_one_layer_at_a_time_and_no_chip_holds_the_whole_batch(compiled):
    config, _, keep = compiled
    program = keep["train_step"]
    hlo = program.as_text()
    stacked = {tuple(x.shape) for x in __import__("jax").tree.leaves(
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
