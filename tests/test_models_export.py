"""export_hf round trip: our model -> HF directory -> transformers, same logits; tokenizer loads too."""
import subprocess
import sys

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


def test_an_exported_tokenizer_loads_as_auto_tokenizer_loads_it(tokenizer, tmp_path):
    """load_pretrained reads a generic tokenizers-backed tokenizer without the auto machinery (which
    imports torch): the same class, vocabulary, special tokens, chat template and ids as AutoTokenizer;
    a folder naming another class still goes through AutoTokenizer."""
    from steprl_jax.models.pretrained import _hf_tokenizer

    tokenizer.save_pretrained(str(tmp_path / "generic"))
    ours, auto = _hf_tokenizer(str(tmp_path / "generic")), transformers.AutoTokenizer.from_pretrained(tmp_path / "generic")
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and ours.special_tokens_map == auto.special_tokens_map
    assert ours.chat_template == auto.chat_template and ours.chat_template is not None
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = <|im_end|>?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text = "  Tabs\tand ünïcode, <|im_start|>tokens<|im_end|> 12345"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.decode(ours(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])

    code = ("import sys; from steprl_jax.models.pretrained import _hf_tokenizer; "
            f"_hf_tokenizer({str(tmp_path / 'generic')!r}); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout == "False\n"  # seconds at every process start

    # any other class name is AutoTokenizer's business
    config = tmp_path / "generic" / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"TokenizersBackend"', '"GPT2Tokenizer"'))
    assert type(_hf_tokenizer(str(tmp_path / "generic"))).__name__ != "TokenizersBackend"
