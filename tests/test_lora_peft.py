"""LoRA adapters in PEFT's format (models/export.py): peft.PeftModel on the base model in
transformers computes what our adapted model does, its merge_and_unload() is our merged export,
the layout agrees with the hf_weights table for every family, and exporting adapters from a model
without any is refused."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict
from safetensors.numpy import load_file

from models_hf_tiny import hf_logits, save_hf_model
from steprl_jax.algorithms.offline import export_adapters
from steprl_jax.models import ModelConfig, Transformer, export_hf, export_peft_adapters, load_pretrained, lora
from steprl_jax.models.export import peft_adapter_tensors
from steprl_jax.models.hf_weights import weight_rules

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


def _randomise(model, seed=1, std=0.1):
    """Random A and B (numpy's: nothing to compile): with B = 0 a swapped, transposed or misnamed
    adapter would go unseen."""
    rng = np.random.default_rng(seed)
    for name in sorted(n for n in vars(model.layers) if n.startswith(lora.PREFIX_A) or n.startswith(lora.PREFIX_B)):
        v = getattr(model.layers, name)
        v.set_value(jnp.asarray(std * rng.standard_normal(v.get_value().shape), jnp.float32))


def test_peft_model_on_the_base_computes_what_ours_does_and_merges_to_our_export(tmp_path):
    save_hf_model("llama", tmp_path / "base", seed=3)
    base_source = str(tmp_path / "base")
    model, _ = load_pretrained(base_source)
    adapted = lora.add_adapters(model, lora.LoraConfig(rank=3, alpha=5.0))  # every target; scale 5/3
    _randomise(adapted)
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 10))
    ours = np.asarray(adapted(ids))

    out = export_hf(adapted, None, str(tmp_path / "policy"), adapters=True, base_source=base_source)
    adapters_dir = os.path.join(out, "adapters")
    with open(os.path.join(adapters_dir, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 3, 5)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    written = load_file(os.path.join(adapters_dir, "adapter_model.safetensors"))
    assert written["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (3, 4 * 16)  # [r, N*H]
    assert written["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 3)  # [D, r]
    alone = export_peft_adapters(adapted, str(tmp_path / "alone"), base_source)  # the same, on its own
    assert json.load(open(os.path.join(alone, "adapter_config.json"))) == config
    assert {k: v.tobytes() for k, v in load_file(os.path.join(alone, "adapter_model.safetensors")).items()} == \
        {k: v.tobytes() for k, v in written.items()}

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    assert np.abs(hf_logits(hf_base.eval(), ids) - ours).max() > 0.1  # the adapters do something
    peft_model = peft.PeftModel.from_pretrained(hf_base, adapters_dir).eval()
    loaded = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert set(loaded) == set(written)  # every tensor found its module, none left over
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(5 / 3)
    np.testing.assert_allclose(hf_logits(peft_model, ids), ours, rtol=0, atol=1e-4)

    merged = peft_model.merge_and_unload()
    exported = load_file(os.path.join(out, "model.safetensors"))
    state = merged.state_dict()
    assert set(exported) <= set(state)
    for name, value in exported.items():
        np.testing.assert_allclose(state[name].numpy(), value, rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(hf_logits(merged, ids), ours, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_layout_is_the_weight_tables(family):
    """B' A' (PEFT's, [out, in]) is the hf_weights export of our update scale * A B, per layer."""
    cfg = ModelConfig.tiny(family)
    adapted = lora.add_adapters(Transformer(cfg, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=2, alpha=6.0))
    _randomise(adapted)
    plain = lora.merged(adapted)
    tensors = dict(peft_adapter_tensors(adapted))
    assert len(tensors) == 2 * len(lora.TARGETS) * cfg.num_layers
    for rule in (r for r in weight_rules(cfg) if r.ours.removeprefix("layers.") in lora.TARGETS):
        target = rule.ours.removeprefix("layers.")
        delta = np.asarray(getattr(plain.layers, target).get_value()) - np.asarray(
            getattr(adapted.layers, target).get_value())
        for i in range(cfg.num_layers):
            module = "base_model.model." + rule.hf.format(i=i).removesuffix(".weight")
            want = 3.0 * tensors[module + ".lora_B.weight"] @ tensors[module + ".lora_A.weight"]
            np.testing.assert_allclose(rule.to_hf(delta[i]), want, rtol=0, atol=1e-5, err_msg=module)


def test_adapters_from_a_model_without_lora_are_refused(tmp_path):
    plain = Transformer(ModelConfig.tiny("llama"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="has none"):
        export_peft_adapters(plain, str(tmp_path / "adapters"), "base")
    with pytest.raises(ValueError, match="has none"):
        export_hf(plain, None, str(tmp_path / "policy"), adapters=True)
    assert not os.listdir(tmp_path)  # refused before anything was written
    with pytest.raises(ValueError, match="export_adapters"):
        export_adapters(ConfigDict(dict(lora=dict(rank=0, alpha=32.0, targets=("q",), export_adapters=True))))
    assert not export_adapters(ConfigDict(dict(lora=dict(rank=4, alpha=32.0, targets=("q",), export_adapters=False))))
    assert export_adapters(ConfigDict(dict(lora=dict(rank=4, alpha=32.0, targets=("q",), export_adapters=True))))
