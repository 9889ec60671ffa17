"""Model presets: the published architectures' parameter counts, exactly (abstract models, no
memory). The figures are the totals of the Hugging Face releases (safetensors metadata); for
tied embeddings (Llama 3.2 1B, Qwen3 1.7B, Gemma) the embedding counts once, and Gemma 3 is its
language model (the releases' "4B" / "12B" include a 417M vision tower)."""
import pytest

from steprl_jax.models.presets import HF_CONFIGS, count_params, preset

PUBLISHED = {
    "smollm2-135m": 134_515_008,  # the embedded default (SmolLM2-135M-Instruct)
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,  # model card: 7.61B, 6.53B non-embedding
    "qwen3-1.7b": 1_720_574_976,  # model card: 1.7B, 1.4B non-embedding
    "qwen3-8b": 8_190_735_360,  # model card: 8.2B, 6.95B non-embedding
    "gemma-2-27b": 27_227_128_320,
    "gemma-3-4b": 3_880_263_168,
    "gemma-3-12b": 11_766_034_176,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_equals_the_published_one(name):
    assert count_params(preset(name)) == PUBLISHED[name]


def test_every_preset_is_counted_and_unknown_names_are_refused():
    assert set(HF_CONFIGS) == set(PUBLISHED)
    with pytest.raises(KeyError, match="qwen2.5-7b"):
        preset("qwen2.5-70b")


def test_non_embedding_counts_match_the_model_cards():
    for name, card in (("qwen2.5-7b", 6.53e9), ("qwen3-8b", 6.95e9), ("qwen3-1.7b", 1.4e9)):
        c = preset(name)
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
        assert abs((count_params(c) - embed) / card - 1) < 0.01, name
