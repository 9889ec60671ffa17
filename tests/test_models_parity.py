"""Each family against Hugging Face transformers (torch as the reference), float32, within 1e-4."""
import numpy as np
import pytest

from models_hf_tiny import HF_CONFIGS, hf_logits, save_hf_model
from steprl_jax.models import attention, load_pretrained

FAMILIES = sorted(HF_CONFIGS)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, directory)
    ours, tokenizer = load_pretrained(str(directory))
    assert tokenizer is None  # a bare weights directory has no tokenizer files
    return request.param, hf, ours


def test_family_detected(pair):
    family, _, ours = pair
    assert ours.config.family == family


def test_logits_match_left_padded_batch(pair):
    """One [3, 20] batch: row 0 is unpadded and longer than any sliding window; rows 1 and 2
    are left-padded (13 and 6 real tokens) with real vocabulary ids under a zero mask."""
    _check_left_padded_batch(pair)


def test_logits_match_with_causal_query_blocks(pair, monkeypatch):
    """The full-sequence attention computed in query blocks of 8 (3 blocks, the last one
    partial), each over the keys up to its end only: the same logits as Hugging Face."""
    monkeypatch.setattr(attention, "CAUSAL_QUERY_BLOCK", 8)
    _check_left_padded_batch(pair)


def _check_left_padded_batch(pair):
    _, hf, ours = pair
    T = 20
    if ours.config.sliding_window:
        assert ours.config.sliding_window < T
    ids = np.random.default_rng(1).integers(0, ours.config.vocab_size, (3, T))
    lengths = np.array([T, 13, 6])
    mask = (np.arange(T)[None, :] >= T - lengths[:, None]).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours_logits = np.asarray(ours(ids, attention_mask_bt=mask))
    ref = hf_logits(hf, ids, mask, positions)
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours_logits[valid], ref[valid], atol=1e-4, rtol=0)
    # The unpadded call convention (no mask, default positions) gives the same first row.
    np.testing.assert_allclose(np.asarray(ours(ids[:1]))[0], ref[0], atol=1e-4, rtol=0)
