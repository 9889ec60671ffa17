"""export_hf round trip: our model -> HF directory -> transformers, same logits; tokenizer loads too."""
import numpy as np
import pytest

from models_hf_tiny import hf_logits, save_hf_model
from steprl_jax.models import export_hf, load_pretrained
from models_real import smollm2_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_round_trip(family, tokenizer, tmp_path):
    save_hf_model(family, tmp_path / "original", seed=3)
    model, _ = load_pretrained(str(tmp_path / "original"))
    out = export_hf(model, tokenizer, str(tmp_path / "exported"))
    assert not [p for p in (tmp_path).iterdir() if ".tmp-" in p.name]  # temp dir renamed away

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                       "gemma3": "Gemma3ForCausalLM"}[family]
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 10))
    np.testing.assert_allclose(hf_logits(reloaded, ids), np.asarray(model(ids)), atol=1e-4, rtol=0)

    text = "Round trip <|im_end|> ok"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]
    ours_again, tok_again = load_pretrained(out)
    # Same architecture; special ids are completed from the exported tokenizer on the way back in.
    plain = dict(pad_token_id=None, eos_token_ids=(), bos_token_id=None)
    assert ours_again.config.replace(**plain) == model.config.replace(**plain)
    assert ours_again.config.pad_token_id is not None
    assert tok_again(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_refuses_to_overwrite(tokenizer, tmp_path):
    save_hf_model("qwen3", tmp_path / "original")
    model, _ = load_pretrained(str(tmp_path / "original"))
    with pytest.raises(FileExistsError, match="original"):
        export_hf(model, None, str(tmp_path / "original"))
    export_hf(model, None, str(tmp_path / "original"), overwrite=True, dtype="bfloat16")
    again, _ = load_pretrained(str(tmp_path / "original"))
    np.testing.assert_allclose(np.asarray(again.embed.get_value()),
                               np.asarray(model.embed.get_value()), rtol=1e-2, atol=1e-3)
