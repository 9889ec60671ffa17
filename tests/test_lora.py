"""LoRA: zero-initialised B is the base model exactly; the merged model (and its Hugging Face
export, loaded back) computes what the adapted one does; training moves the adapters only, with
the base weights bit-identical; and an online RL job trains adapters end to end (exported merged,
and apart in PEFT's format: tests/test_lora_peft.py loads those in peft)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from steprl_jax.models import ModelConfig, Transformer, export_hf, load_pretrained, lora
from steprl_jax.training import LossConfig, TrainStepConfig, create_train_state, make_train_step
from steprl_jax.training.batch import Batch
from steprl_jax.training.state import merge_model, split_model

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


def _ids(seed=0, shape=(2, 12)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), jnp.int32)


def _randomise_b(model, seed=1, std=0.05):
    for i, name in enumerate(lora.TARGETS):
        v = getattr(model.layers, lora.PREFIX_B + name, None)
        if v is not None:
            v.set_value(std * jax.random.normal(jax.random.PRNGKey(seed + i), v.get_value().shape))


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_b_is_the_base_model_and_merged_equals_unmerged(family):
    cfg = ModelConfig.tiny(family)
    base = Transformer(cfg, rngs=nnx.Rngs(0))
    adapted = lora.add_adapters(Transformer(cfg, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=4, alpha=8.0))
    ids = _ids()
    np.testing.assert_array_equal(np.asarray(adapted(ids)), np.asarray(base(ids)))
    _randomise_b(adapted)
    out = adapted(ids)
    assert float(jnp.max(jnp.abs(out - base(ids)))) > 1e-2  # the adapters do something
    plain = lora.merged(adapted)
    assert not lora.has_adapters(plain) and lora.has_adapters(adapted)
    assert nnx.split(plain)[0] == nnx.split(base)[0]  # a plain model: the sampler and export take it
    np.testing.assert_allclose(np.asarray(plain(ids)), np.asarray(out), rtol=0, atol=1e-5)
    # by hand for one projection: W + (alpha / r) A B
    a, b = adapted.layers.lora_a_q.get_value(), adapted.layers.lora_b_q.get_value()
    want = base.layers.q.get_value() + 2.0 * jnp.einsum("ldr,lrnh->ldnh", a, b)
    np.testing.assert_allclose(np.asarray(plain.layers.q.get_value()), np.asarray(want), rtol=0, atol=1e-6)


def test_merged_export_loads_back_and_equals_the_adapted_forward(tmp_path):
    from swirl_helpers import smol_tokenizer, tiny_model

    tokenizer = smol_tokenizer()
    adapted = lora.add_adapters(tiny_model(tokenizer, seed=3), lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "down")))
    _randomise_b(adapted)
    ids = _ids(shape=(1, 10))
    out = export_hf(lora.merged(adapted), tokenizer, str(tmp_path / "merged"))
    loaded, _ = load_pretrained(out)
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(adapted(ids)), rtol=0, atol=1e-5)


def test_training_moves_only_the_adapters():
    cfg = ModelConfig.tiny("llama")
    model = lora.add_adapters(Transformer(cfg, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=4, alpha=8.0))
    base_before = jax.tree.map(np.array, split_model(model)[2])
    tx = optax.adam(1e-2)
    graphdef, state, _ = create_train_state(model, tx, seed=0)
    n_trainable = sum(x.size for x in jax.tree.leaves(state.params))
    assert n_trainable == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_trainable < 0.5 * sum(x.size for x in jax.tree.leaves(base_before))
    step = make_train_step(graphdef, tx, TrainStepConfig(loss=LossConfig(kind="sft")))
    ids = _ids(2, (4, 16))
    mask = jnp.ones((4, 16), jnp.float32).at[:, 0].set(0)
    batch = Batch(tokens=ids, loss_mask=mask, advantages=jnp.zeros_like(mask), old_logp=jnp.zeros_like(mask))
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(jax.tree.map(np.array, state.rest))):
        np.testing.assert_array_equal(a, b)  # frozen, bit for bit
    trained = merge_model(graphdef, state.params, state.rest)
    assert float(jnp.max(jnp.abs(trained.layers.lora_b_q.get_value()))) > 0


def test_bad_lora_settings_are_refused():
    with pytest.raises(ValueError, match="rank"):
        lora.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="qkv"):
        lora.LoraConfig(rank=2, targets=("qkv",))
    model = lora.add_adapters(Transformer(ModelConfig.tiny("llama"), rngs=nnx.Rngs(0)), lora.LoraConfig(rank=2))
    with pytest.raises(ValueError, match="already"):
        lora.add_adapters(model, lora.LoraConfig(rank=2))


def test_online_grpo_trains_lora_adapters_end_to_end(tmp_path):
    from rl_helpers import VerdictServer, tiny_rl_config
    from safetensors.numpy import load_file
    from steprl_jax.algorithms import online
    from swirl_helpers import smol_tokenizer, tiny_model

    tokenizer = smol_tokenizer()
    server = VerdictServer()
    try:
        c = tiny_rl_config(tmp_path, "grpo", server.base_url, iterations=2)
        c.rl.eval.num_tasks = 0
        c.lora.rank = 4
        c.lora.export_adapters = True  # policy/rl/adapters: the same adapters in PEFT's format
        c.rl.grpo.kl_coef = 0.01  # the reference is the base model (B = 0)
        online.run(c, (tiny_model(tokenizer, seed=7), tokenizer))
    finally:
        server.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2]
    assert abs(lines[0]["first_ratio"] - 1.0) < 1e-5 and lines[0]["first_clipfrac"] == 0.0
    assert lines[1]["grad_norm"] > 0 and lines[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    exported = load_file(os.path.join(tmp_path, "policy", "rl", "model.safetensors"))
    assert not any("lora" in k for k in exported)  # merged HF weights
    original = export_hf(tiny_model(tokenizer, seed=7), tokenizer, str(tmp_path / "base"))
    base_weights = load_file(os.path.join(original, "model.safetensors"))
    moved = [k for k in exported if not np.array_equal(exported[k], base_weights[k])]
    assert moved and all(any(p in k for p in ("proj",)) for k in moved), moved  # only adapted projections
    adapters = os.path.join(tmp_path, "policy", "rl", "adapters")
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == c.model.source  # what the run started from
    pairs = load_file(os.path.join(adapters, "adapter_model.safetensors"))
    for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):  # base + (alpha / r) B A
        lora_a, lora_b = (pairs[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
        np.testing.assert_allclose(base_weights[name + ".weight"] + (32.0 / 4) * lora_b @ lora_a,
                                   exported[name + ".weight"], rtol=0, atol=1e-6)
