"""Sampler on tiny random models: log-probs, continue, fork, stop strings, keys, buckets, bad input, sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from steprl_jax.models import ModelConfig, Transformer
from steprl_jax.models.sharding import make_mesh, shard_model
from steprl_jax.sampling import ContextOverflowError, Sampler, SamplingParams, bucket
from steprl_jax.sampling.stop import TwoPartStop, build_automaton, first_stop, token_transition_table

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
GREEDY = SamplingParams(greedy=True)


class ByteTokenizer:
    """Token i stands for 1-3 bytes over the alphabet `</ab>`: tags split across and inside tokens."""

    ALPHABET = b"</ab>"

    def __init__(self, vocab_size):
        self.table = []
        for i in range(vocab_size):
            n, digits = 1 + i % 3, []
            x = i // 3
            for _ in range(n):
                digits.append(self.ALPHABET[x % 5])
                x //= 5
            self.table.append(bytes(digits))

    def token_bytes_table(self):
        return self.table


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(eos_token_ids=()), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, ByteTokenizer(model.config.vocab_size))


@jax.jit
def _forward(state, ids):
    return nnx.merge(*state)(ids)


def full_logprobs(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) of a full forward over prompt + tokens, at the generated positions."""
    seq = list(prompt) + [int(t) for t in tokens]
    padded = seq + [0] * (64 - len(seq))  # right padding: causal, so earlier logits are unchanged
    logits = _forward(nnx.split(model), jnp.asarray([padded]))[0, :len(seq)] / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    pos = np.arange(len(prompt) - 1, len(seq) - 1)
    return np.asarray(logp[pos, np.asarray(seq[len(prompt):])]), np.asarray(logp[pos])


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.7, with_entropy=True),
                                    SamplingParams(temperature=1.3, top_k=20, top_p=0.9)])
def test_recorded_logprobs_equal_full_forward(model, sampler, params):
    state = sampler.prefill(PROMPTS)
    _, gens = sampler.generate(state, jax.random.PRNGKey(1), max_new_tokens=[12, 20, 7], params=params)
    assert [len(g.tokens) for g in gens] == [12, 20, 7]
    assert all(g.finish_reason == "length" for g in gens)
    for prompt, g in zip(PROMPTS, gens):
        ref, all_logp = full_logprobs(model, prompt, g.tokens, params.temperature)
        np.testing.assert_allclose(g.logprobs, ref, atol=1e-4)
        if params.greedy:
            np.testing.assert_array_equal(g.tokens, all_logp.argmax(-1))
        if params.with_entropy:
            ent = -(np.exp(all_logp) * all_logp).sum(-1)
            np.testing.assert_allclose(g.entropies, ent, atol=1e-4)
        if params.top_k:  # every sampled token is among the top k of its step
            rank = (all_logp > all_logp[np.arange(len(g.tokens)), g.tokens][:, None]).sum(-1)
            assert rank.max() < params.top_k


def test_continue_equals_generating_from_scratch(model, sampler):
    state = sampler.prefill(PROMPTS)
    state, first = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=9, params=GREEDY)
    tool = [[30, 31, 32], [], [40, 41, 42, 43, 44, 45]]
    state = sampler.append(state, tool)
    state, second = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=11, params=GREEDY)
    contexts = [p + list(g.tokens) + t for p, g, t in zip(PROMPTS, first, tool)]
    scratch = sampler.prefill(contexts)
    _, again = sampler.generate(scratch, jax.random.PRNGKey(0), max_new_tokens=11, params=GREEDY)
    for a, b in zip(second, again):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    np.testing.assert_array_equal(state.lengths, [len(c) + 11 for c in contexts])


def test_fork_branches_equal_independent_runs_with_the_same_keys(model, sampler):
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    params = SamplingParams(temperature=1.0)
    prefix = PROMPTS[0]
    state = sampler.prefill([prefix, PROMPTS[1]])
    state, _ = sampler.generate(state, jax.random.PRNGKey(3), max_new_tokens=5, params=params)
    state = sampler.append(state, [[50, 51], [52]])
    context = sampler.fork(state, [0])  # keep a copy of row 0 before the fork consumes nothing
    forked = sampler.fork(state, [0, 0, 0, 0])
    forked, branches = sampler.generate(forked, keys, max_new_tokens=15, params=params)
    # Independent runs: the same context, one at a time, each with its branch's key.
    row0 = context
    for j in range(4):
        single = sampler.fork(row0, [0])
        _, (alone,) = sampler.generate(single, keys[j][None], max_new_tokens=15, params=params)
        np.testing.assert_array_equal(branches[j].tokens, alone.tokens)
        np.testing.assert_allclose(branches[j].logprobs, alone.logprobs, atol=1e-5)
    assert len({tuple(b.tokens) for b in branches}) > 1  # the branches' streams differ


def test_shared_prompt_prefix_is_prefilled_once_with_the_same_results(model):
    rng = np.random.default_rng(3)
    header = list(rng.integers(3, 200, size=40))  # e.g. a system prompt and few-shot examples
    prompts = [header + list(rng.integers(3, 200, size=n)) for n in (5, 0, 17, 9)]
    shared, separate = Sampler(model, min_shared_prefix=32), Sampler(model, min_shared_prefix=0)
    params = SamplingParams(temperature=1.0)
    runs = []
    for s in (shared, separate):
        state = s.prefill(prompts)
        runs.append((state, s.generate(state, jax.random.PRNGKey(5), max_new_tokens=12, params=params)[1]))
    (state_a, gens_a), (state_b, gens_b) = runs
    assert state_a.lengths.tolist() == state_b.lengths.tolist() == [len(p) for p in prompts]
    for a, b, prompt in zip(gens_a, gens_b, prompts):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.logprobs, full_logprobs(model, prompt, a.tokens)[0], atol=1e-4)
    # The header went through the model once (one row), not once per prompt, and is held once.
    assert any(k == "extend" and p.batch == 1 for k, p in shared._programs)
    # (all but the last header token: one prompt is the header alone, and its last token is pending)
    assert state_a.shared_ids.tolist() == header[:-1] and state_a.slots_held().tolist() == [len(p) - 40 for p in prompts]
    assert not any(k == "extend" and p.batch == 1 for k, p in separate._programs)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: sliding-window layers over the segment, softcaps
def test_rows_on_a_shared_segment_generate_as_rows_of_their_own(family):
    """The shared prefix is held once (each row's cache holds its rest); rows on it, forked,
    appended to one at a time, compacted, and rows inserted on and off it all generate what a
    sampler without segments does, and what a full forward gives."""
    model = Transformer(ModelConfig.tiny(family, eos_token_ids=()), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(4)
    header = rng.integers(3, 200, size=45).tolist()  # longer than gemma2's window of 8
    prompts = [header + rng.integers(3, 200, size=n).tolist() for n in (3, 11, 6)]
    on, off = (Sampler(model, min_shared_prefix=m, min_cache_length=16, min_extend_length=8) for m in (32, 0))
    params = SamplingParams(temperature=1.0)
    keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(2), i))(jnp.arange(4)))
    runs = []
    for s in (on, off):
        state = s.prefill(prompts)
        state, first = s.generate(state, keys[:3], max_new_tokens=5, params=params)
        state = s.fork(state, [0, 1, 2, 1])  # row 3 branches off row 1
        state = s.append(state, [[], [], [7, 8, 9], []])  # one row: copied out, extended, written back
        state = s.clear(state, [0, 3])
        state = s.insert(state, [0, 3], [header + [60, 61], [90, 91, 92]])  # on the segment, then off it
        state, gens = s.generate(state, keys, max_new_tokens=30, params=params)  # grows or compacts
        runs.append((state, first, gens))
    (state_on, first_on, gens_on), (state_off, first_off, gens_off) = runs
    assert state_off.shared is None and state_on.shared_ids.tolist() == header
    assert state_on.row_shared.tolist() == [True, True, True, False]
    assert state_on.cache_length < state_off.cache_length  # the rows hold their rests only
    for a, b in zip(first_on + gens_on, first_off + gens_off):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    contexts = [header + [60, 61], prompts[1] + first_on[1].tokens.tolist(),
                prompts[2] + first_on[2].tokens.tolist() + [7, 8, 9], [90, 91, 92]]
    for context, g in zip(contexts, gens_on):
        np.testing.assert_allclose(g.logprobs, full_logprobs(model, context, g.tokens)[0], atol=1e-4)


def test_a_mixed_insert_that_does_not_fit_raises_and_leaves_the_state_intact(model):
    """Prompts on the segment and off it are inserted in two writes: both are checked first, so
    an error leaves the running state as it was. Cleared rows leave the segment (on device too)."""
    capped = Sampler(model, max_cache_length=64, min_cache_length=16, min_extend_length=16, min_shared_prefix=8)
    header = list(range(100, 140))
    prompts = [header + [5, 6], header + [7, 8, 9]]
    cleared = capped.clear(capped.prefill(prompts), [1])
    assert np.asarray(cleared.cache.row_shared)[:2].tolist() == [True, False]
    state = capped.prefill(prompts)
    with pytest.raises(ContextOverflowError, match="insert: 96 cache slots needed, at most 64"):
        capped.insert(state, [0, 1], [header + [10, 11], list(range(3, 73))])
    _, gens = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    _, ref = capped.generate(capped.prefill(prompts), jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    assert [g.tokens.tolist() for g in gens] == [g.tokens.tolist() for g in ref]


def test_shared_prefix_prefill_respects_the_cache_cap(model, sampler):
    header = list(range(3, 43))
    prompts = [header + list(range(start, start + n)) for start, n in ((50, 5), (100, 20))]
    capped = Sampler(model, min_cache_length=16, max_cache_length=64, min_extend_length=4, min_shared_prefix=8)
    state = capped.prefill(prompts)
    assert state.cache_length <= 64
    _, gens = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    _, ref = sampler.generate(sampler.prefill(prompts), jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    assert [g.tokens.tolist() for g in gens] == [g.tokens.tolist() for g in ref]


def test_same_key_same_tokens_and_batch_invariance(sampler):
    params = SamplingParams(temperature=1.0, top_p=0.95)
    key = jax.random.PRNGKey(11)
    _, a = sampler.generate(sampler.prefill(PROMPTS), key, max_new_tokens=16, params=params)
    _, b = sampler.generate(sampler.prefill(PROMPTS), key, max_new_tokens=16, params=params)
    _, c = sampler.generate(sampler.prefill(PROMPTS), jax.random.PRNGKey(12), max_new_tokens=16, params=params)
    assert [g.tokens.tolist() for g in a] == [g.tokens.tolist() for g in b]
    assert [g.tokens.tolist() for g in a] != [g.tokens.tolist() for g in c]
    # Row 1 alone, given row 1's key, samples the same tokens as inside the batch.
    row_key = jax.random.fold_in(key, 1)
    _, (alone,) = sampler.generate(sampler.prefill([PROMPTS[1]]), row_key[None], max_new_tokens=16, params=params)
    assert alone.tokens.tolist() == a[1].tokens.tolist()


def test_stop_strings_split_across_tokens_end_the_text_exactly(model, sampler):
    tokenizer = sampler.tokenizer
    state = sampler.prefill(PROMPTS)
    _, free = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=40, params=GREEDY)
    for g in free:
        pieces = [tokenizer.table[t] for t in g.tokens]
        text = b"".join(pieces).decode()
        ends = np.cumsum([len(p) for p in pieces])
        # A stop string spanning >= 2 tokens and ending strictly inside a token, when one exists.
        cut = next((e for e in range(5, len(text)) if e not in set(ends) and
                    np.searchsorted(ends, e - 4, side="right") < np.searchsorted(ends, e, side="left")), None)
        if cut is None:
            continue
        stop = text[cut - 4:cut]
        end, _ = first_stop(text, [stop])
        k = int(np.searchsorted(ends, end, side="left")) + 1  # tokens up to the one completing the stop
        _, (g2,) = sampler.generate(sampler.prefill([PROMPTS[free.index(g)]]), jax.random.PRNGKey(0),
                                    max_new_tokens=40, params=GREEDY, stop=[stop, "zzzz"])
        assert g2.finish_reason == "stop" and g2.stop_string == stop
        assert g2.text == text[:end] and g2.text.endswith(stop)
        assert g2.tokens.tolist() == g.tokens[:k].tolist()
        assert g2.text_after_stop == text[end:ends[k - 1]]
        break
    else:
        pytest.fail("no generated text had a suitable stop string")


def test_a_two_part_stop_stops_at_the_first_close_after_an_open(model, sampler):
    """On device: a close that occurs before the open does not stop; the first one after it
    does, at exactly the token completing it (both parts may span tokens)."""
    state = sampler.prefill(PROMPTS[:1])
    _, (free,) = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=60, params=GREEDY)
    pieces = [sampler.tokenizer.table[t] for t in free.tokens]
    text = b"".join(pieces).decode()
    ends = np.cumsum([len(p) for p in pieces])
    found = None
    for a in range(len(text) - 3):  # an open whose end some close precedes and follows
        opening = text[a:a + 3]
        opened = text.find(opening) + 3
        for c in range(opened, len(text) - 3):
            close = text[c:c + 3]
            if text.find(close) + 3 <= opened:
                found = (opening, close)
                break
        if found:
            break
    assert found, text
    stop = TwoPartStop((found[0],), found[1])
    end, which = first_stop(text, [stop])
    assert which == found[1] and end > text.find(found[1]) + 3  # the earlier close did not count
    _, (g,) = sampler.generate(sampler.prefill(PROMPTS[:1]), jax.random.PRNGKey(0), max_new_tokens=60,
                               params=GREEDY, stop=[stop])
    k = int(np.searchsorted(ends, end, side="left")) + 1
    assert g.finish_reason == "stop" and g.stop_string == found[1]
    assert g.text == text[:end] and g.tokens.tolist() == free.tokens[:k].tolist()
    assert g.text_after_stop == text[end:ends[k - 1]]


def test_stop_automaton_matches_python_search():
    rng = np.random.default_rng(0)
    patterns = [b"</a>", b"ab", b"<b/b>", b"bb/"]
    tokens = [bytes(rng.choice(list(b"</ab>"), size=rng.integers(1, 4))) for _ in range(60)]
    table = token_transition_table(patterns, tokens, 32)
    delta, accept = build_automaton(patterns)
    for _ in range(200):
        seq = rng.integers(0, len(tokens), size=12)
        state, hit, text = 0, None, b""
        for i, t in enumerate(seq):
            text += tokens[t]
            state = table[state, t]
            if state < 0:
                hit = i
                break
        first = min((text.find(p) + len(p) for p in patterns if p in text), default=None)
        expect = None
        if first is not None:  # the index of the token whose bytes reach `first`
            expect = int(np.searchsorted(np.cumsum([len(tokens[t]) for t in seq[:hit + 1]]), first))
        assert hit == expect


def test_eos_and_per_row_limits(model):
    probe = Sampler(model)
    _, free = probe.generate(probe.prefill(PROMPTS), jax.random.PRNGKey(0), max_new_tokens=12, params=GREEDY)
    eos = int(free[0].tokens[3])
    _, gens = probe.generate(probe.prefill(PROMPTS), jax.random.PRNGKey(0), max_new_tokens=[12, 0, 5],
                             params=GREEDY, stop_token_ids=[eos])
    first_eos = free[0].tokens.tolist().index(eos)
    assert gens[0].finish_reason == "eos" and gens[0].tokens.tolist() == free[0].tokens[:first_eos + 1].tolist()
    assert gens[1].finish_reason == "length" and len(gens[1].tokens) == 0
    assert len(gens[2].tokens) <= 5


def test_bad_input_fails_before_compiling(model):
    s = Sampler(model, max_context=40)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        s.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="no prompts"):
        s.prefill([])
    with pytest.raises(ContextOverflowError, match="prompt 0 has 41 tokens"):
        s.prefill([list(range(41))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.prefill([[1, 99999]])
    assert s.num_compiled == 0
    state = s.prefill([[1, 2, 3]])
    compiled = s.num_compiled
    with pytest.raises(ValueError, match="stop_token_ids: token id 1000"):
        s.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, stop_token_ids=[1000])
    with pytest.raises(ValueError, match="need a tokenizer"):
        s.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, stop=["</a>"])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    assert s.num_compiled == compiled
    # Overflow during an episode: a clean finish with reason `context`, never a truncation.
    state, (g,) = s.generate(state, jax.random.PRNGKey(0), max_new_tokens=100, params=GREEDY)
    assert g.finish_reason == "context" and state.lengths[0] == 40 and len(g.tokens) == 37
    with pytest.raises(ContextOverflowError, match="row 0 would reach 41"):
        s.append(state, [[5]])
    state, (g,) = s.generate(state, jax.random.PRNGKey(0), max_new_tokens=3, params=GREEDY)
    assert g.finish_reason == "context" and len(g.tokens) == 0


def test_growth_and_compaction_change_nothing(model, sampler):
    """A small cache that must grow and compact gives what a roomy cache gives."""
    small = Sampler(model, min_cache_length=16, max_cache_length=48, min_extend_length=4)
    results = []
    for s in (small, sampler):
        state = s.prefill([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]])
        out = []
        for step in range(3):
            state, gens = s.generate(state, jax.random.PRNGKey(step), max_new_tokens=[6, 2 + step],
                                     params=GREEDY)
            out.append([g.tokens.tolist() for g in gens])
            state = s.append(state, [[60 + step] * (step + 1), [70]])
            if step == 1:
                state = s.fork(state, [1, 0])
        results.append((out, state.lengths.tolist()))
    assert results[0] == results[1]
    assert small.num_compiled > 0 and max(p[1].cache_length for p in small._programs
                                          if hasattr(p[1], "cache_length")) <= 48
    assert any(kind == "compact" for kind, _ in small._programs)


def test_buckets_keep_programs_few(model):
    s = Sampler(model)
    rng = np.random.default_rng(0)
    for _ in range(6):
        n = int(rng.integers(3, 5))
        prompts = [list(rng.integers(3, 200, size=rng.integers(2, 14))) for _ in range(n)]
        state = s.prefill(prompts)
        s.generate(state, jax.random.PRNGKey(0), max_new_tokens=int(rng.integers(9, 16)), params=GREEDY)
    # batch buckets {3, 4}, one extend length, one cache length, one max_new bucket
    assert s.num_compiled <= 4
    assert [bucket(n) for n in (1, 2, 3, 5, 7, 9, 13, 100)] == [1, 2, 3, 6, 8, 12, 16, 128]


def test_sharded_parameters_and_batch(model, sampler):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_model(nnx.clone(model), mesh)
    s = Sampler(sharded, mesh=mesh)
    ref = sampler
    params = SamplingParams(temperature=0.9, with_entropy=True)
    key = jax.random.PRNGKey(5)
    state, gens = s.generate(s.prefill(PROMPTS), key, max_new_tokens=10, params=params)
    assert state.batch_bucket % 4 == 0
    assert state.cache.k[0].sharding.spec[0] == ("data", "fsdp")
    state = s.append(state, [[1, 2], [3], []])
    state = s.fork(state, [2, 0])
    state, more = s.generate(state, key, max_new_tokens=5, params=params)
    r_state, r_gens = ref.generate(ref.prefill(PROMPTS), key, max_new_tokens=10, params=params)
    r_state = ref.fork(ref.append(r_state, [[1, 2], [3], []]), [2, 0])
    _, r_more = ref.generate(r_state, key, max_new_tokens=5, params=params)
    for a, b in zip(gens + more, r_gens + r_more):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_shared_segment_on_a_mesh(model, sampler):
    """The segment is replicated over the batch axes (its kv heads split like the rows'): rows on
    it, sharded, generate what the unsharded sampler does."""
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    s = Sampler(shard_model(nnx.clone(model), mesh), mesh=mesh)
    header = list(range(60, 100))
    prompts = [header + [5, 6], header + [7], header + [8, 9, 10]]
    key = jax.random.PRNGKey(6)
    state, gens = s.generate(s.prefill(prompts), key, max_new_tokens=8, params=GREEDY)
    assert state.shared is not None and state.cache.row_shared.sharding.spec[0] == ("data", "fsdp")
    state = s.insert(s.clear(state, [1]), [1], [header + [11, 12]])
    _, more = s.generate(state, key, max_new_tokens=6, params=GREEDY)
    r_state, r_gens = sampler.generate(sampler.prefill(prompts), key, max_new_tokens=8, params=GREEDY)
    r_state = sampler.insert(sampler.clear(r_state, [1]), [1], [header + [11, 12]])
    _, r_more = sampler.generate(r_state, key, max_new_tokens=6, params=GREEDY)
    for a, b in zip(gens + more, r_gens + r_more):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_bf16_recorded_logprobs_equal_the_trainers_recomputation():
    """bf16 compute: weights cast once by the sampler; a full forward + token_logprobs (the
    trainer's path, float32 parameters) gives the same log-probs."""
    from steprl_jax.ops.logprobs import token_logprobs

    model = Transformer(ModelConfig.tiny(compute_dtype="bfloat16", eos_token_ids=()), rngs=nnx.Rngs(3))
    s = Sampler(model)
    assert s._params["layers"]["q"].get_value().dtype == jnp.bfloat16
    assert all(p["q"].dtype == jnp.bfloat16 and p["attn_norm"].dtype == jnp.float32 for p in s._layer_params)
    compiled = s._unstack_jit._cache_size()
    s.set_params(model)  # a policy update reuses the compiled unstacking program
    assert s._unstack_jit._cache_size() == compiled
    assert s._params["final_norm"].get_value().dtype == jnp.float32
    prompt = [1, 2, 3, 4]
    state, (g,) = s.generate(s.prefill([prompt]), jax.random.PRNGKey(0), max_new_tokens=10,
                             params=SamplingParams(temperature=0.8))
    assert state.cache.k[0].dtype == jnp.bfloat16
    seq = prompt + g.tokens.tolist()
    hidden = model.hidden_states(jnp.asarray([seq]))
    logp = token_logprobs(hidden, model.unembedding(), jnp.asarray([seq[1:] + [0]]), temperature=0.8,
                          compute_dtype=jnp.bfloat16)[0, len(prompt) - 1:-1]
    np.testing.assert_allclose(g.logprobs, logp, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the default is CPU-specific")
def test_bf16_single_row_decodes_beside_a_padding_row_with_the_same_results():
    model = Transformer(ModelConfig.tiny(compute_dtype="bfloat16", eos_token_ids=()), rngs=nnx.Rngs(3))
    wide, narrow = Sampler(model), Sampler(model, min_decode_batch=1)
    assert wide.min_decode_batch == 2
    runs = []
    for s in (wide, narrow):
        state = s.prefill([[1, 2, 3, 4]])
        assert state.batch_bucket == 1  # the prefill itself is not padded
        state, gens = s.generate(state, jax.random.PRNGKey(0), max_new_tokens=10,
                                 params=SamplingParams(temperature=0.8))
        state, more = s.generate(s.append(state, [[5, 6]]), jax.random.PRNGKey(1), max_new_tokens=4,
                                 params=SamplingParams(temperature=0.8))
        runs.append((state, gens + more))
    (w_state, w_gens), (n_state, n_gens) = runs
    assert (w_state.batch_bucket, n_state.batch_bucket) == (2, 1) and w_state.num_rows == 1
    for a, b in zip(w_gens, n_gens):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="min_decode_batch"):
        Sampler(model, min_decode_batch=0)


def test_the_host_copy_of_the_pending_tokens_follows_the_device(sampler):
    # append reads the pending tokens from the host copy (no device round trip): it must always
    # equal the device's, through prefill, generate (rows that sample and rows that do not),
    # append (rows that get tokens and rows that do not) and fork.
    def same(state):
        assert state.last_host.tolist() == np.asarray(state.last_token)[:state.num_rows].tolist()

    state = sampler.prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    same(state)
    state, _ = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=[4, 0, 2], stop_token_ids=())
    same(state)
    state = sampler.append(state, [[20, 21], [], [22]])
    same(state)
    state = sampler.fork(state, [2, 0, 0, 1])
    same(state)
    state, _ = sampler.generate(state, jax.random.PRNGKey(1), max_new_tokens=3, stop_token_ids=())
    same(state)


def test_set_params_places_the_trainers_parameters_with_the_samplers_shardings(model, sampler):
    # the trainer keeps its parameters fsdp-sharded over 8 devices; the sampler's mesh is
    # data x tensor: set_params moves them device to device into the sampler's layout
    trainer = shard_model(nnx.clone(model), make_mesh(data=1, fsdp=8, tensor=1))
    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    s = Sampler(shard_model(nnx.clone(model), mesh), mesh=mesh)
    placed = lambda: [(x.sharding.mesh.shape, x.sharding.spec) for x in jax.tree.leaves((s._params, s._layer_params))
                      if x.size]  # (the stacked layers' empty placeholders live nowhere in particular)
    before = placed()
    s.set_params(trainer)
    assert placed() == before and all(shape == mesh.shape for shape, _ in before)
    key = jax.random.PRNGKey(3)
    _, got = s.generate(s.prefill(PROMPTS), key, max_new_tokens=6, params=GREEDY)
    _, want = sampler.generate(sampler.prefill(PROMPTS), key, max_new_tokens=6, params=GREEDY)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def _chunked(sampler, state, keys, max_new, params, stop=(), max_steps=3, return_on_finish=True):
    """Generate by repeated short calls, continuing the running rows, until every row finishes."""
    running = [None] * state.num_rows
    calls = 0
    while True:
        todo = np.asarray([0 if g is not None and g.finish_reason != "running" else m
                           for g, m in zip(running, max_new)])
        if not todo.any():
            return running, calls
        state, gens = sampler.generate(state, keys, max_new_tokens=todo, params=params, stop=stop,
                                       running=[g if g is not None and g.finish_reason == "running" else None
                                                for g in running],
                                       max_steps=max_steps, return_on_finish=return_on_finish)
        calls += 1
        running = [g if m else old for g, m, old in zip(gens, todo, running)]


@pytest.mark.parametrize("return_on_finish", [False, True])
def test_generation_in_short_calls_equals_one_call(model, sampler, return_on_finish):
    """Continued rows: same tokens, log-probs, finish reasons and stop-string cuts as one long call,
    also for a stop string that straddles two calls."""
    params = SamplingParams(temperature=1.0, with_entropy=True)
    keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(5), i))(jnp.arange(3)))
    max_new = [20, 9, 14]
    _, free = sampler.generate(sampler.prefill(PROMPTS), keys, max_new_tokens=max_new, params=params)
    text = sampler.decode_text(free[0].tokens)
    stop = (text[5:8],)  # ends row 0 after its 5th byte or so: inside the first call or across two
    _, whole = sampler.generate(sampler.prefill(PROMPTS), keys, max_new_tokens=max_new, params=params, stop=stop)
    parts, calls = _chunked(sampler, sampler.prefill(PROMPTS), keys, max_new, params, stop=stop,
                            return_on_finish=return_on_finish)
    assert calls > 3
    for a, b in zip(whole, parts):
        assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
        np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-6)
        assert (a.text, a.stop_string, a.text_after_stop) == (b.text, b.stop_string, b.text_after_stop)
    assert whole[0].finish_reason == "stop"


def test_a_short_call_returns_when_a_row_finishes(model, sampler):
    state = sampler.prefill(PROMPTS)
    _, gens = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=[30, 2, 30], params=GREEDY,
                               return_on_finish=True)
    assert [g.finish_reason for g in gens] == ["running", "length", "running"]
    assert [len(g.tokens) for g in gens] == [2, 2, 2] and gens[0].text is None


def test_inserted_prompts_generate_as_if_prefilled(model, sampler):
    """`insert` into a running state: the new rows continue exactly like freshly prefilled ones,
    and the rows beside them are untouched."""
    params = SamplingParams(temperature=1.0)
    keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(9), i))(jnp.arange(3)))
    state = sampler.prefill(PROMPTS)
    state, first = sampler.generate(state, keys, max_new_tokens=6, params=params)
    state = sampler.clear(state, [1])
    new_prompts = [[30, 31, 32, 33, 34], [40, 41]]
    state = sampler.insert(state, [1, 2], new_prompts)
    assert state.lengths.tolist()[1:] == [5, 2]
    _, after = sampler.generate(state, keys, max_new_tokens=8, params=params)
    # Row 0 goes on as if nothing happened.
    _, (row0,) = sampler.generate(sampler.prefill([PROMPTS[0] + first[0].tokens.tolist()]), keys[:1],
                                  max_new_tokens=8, params=params)
    assert after[0].tokens.tolist() == row0.tokens.tolist()
    _, fresh = sampler.generate(sampler.prefill([PROMPTS[0]] + new_prompts), keys, max_new_tokens=8, params=params)
    for prompt, a, b in zip(new_prompts, after[1:], fresh[1:]):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.logprobs, full_logprobs(model, prompt, a.tokens)[0], atol=1e-4)


def test_insert_and_clear_bad_input(sampler):
    state = sampler.prefill(PROMPTS)
    with pytest.raises(IndexError, match="insert: rows must be in"):
        sampler.insert(state, [3], [[1, 2]])
    with pytest.raises(ValueError, match="insert: got 1 prompts for 2 rows"):
        sampler.insert(state, [0, 1], [[1, 2]])
    with pytest.raises(ValueError, match="rows repeat"):
        sampler.insert(state, [1, 1], [[1, 2], [3]])
    with pytest.raises(ValueError, match="running generations for 3 rows"):
        sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=2, running=[None])
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=2, max_steps=0)


def test_insert_beside_padding_rows_and_after_compaction(model):
    """Five rows (a batch bucket of 6: one padding row, a copy of row 0 from the shared-prefix
    prefill) and a capped cache: clearing row 0, inserting short prompts, compacting and
    inserting again keep every row's tokens equal to a fresh prefill of its context."""
    capped = Sampler(model, ByteTokenizer(model.config.vocab_size), max_cache_length=128, min_cache_length=32)
    compactions = []
    capped._compact_jit = lambda n, cache, _f=capped._compact_jit: compactions.append(n) or _f(n, cache)
    shared = list(range(40, 80))
    prompts = [shared + [i] for i in range(5)]
    state = capped.prefill(prompts)
    assert state.batch_bucket == 6
    state, gens = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=20, params=GREEDY)
    contexts = [p + g.tokens.tolist() for p, g in zip(prompts, gens)]
    for round_ in range(5):  # each round: a row ends, a short prompt takes it; the cache compacts
        row = round_ % 5
        state = capped.clear(state, [row])
        contexts[row] = [7 + round_, 8, 9]
        state = capped.insert(state, [row], [contexts[row]])
        state, gens = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=16, params=GREEDY)
        contexts = [c + g.tokens.tolist() for c, g in zip(contexts, gens)]
    assert state.cache_length <= 128 and max(compactions) >= 96  # the running cache was compacted
    _, after = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=8, params=GREEDY)
    _, fresh = capped.generate(capped.prefill(contexts), jax.random.PRNGKey(0), max_new_tokens=8, params=GREEDY)
    assert [g.tokens.tolist() for g in after] == [g.tokens.tolist() for g in fresh]


def test_insert_takes_the_rows_own_slots_before_the_write_index(model, sampler):
    """A running state whose write index is past the new prompt's width takes it in the target
    rows' own (dropped) slots: the cache neither grows nor moves its index, and the new row
    continues as a fresh prefill of its prompt would."""
    state = sampler.prefill([list(range(10, 60)), [3, 4]])
    state, _ = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    length, index = state.cache_length, state.index
    state = sampler.insert(state, [1], [list(range(5, 30))])
    assert (state.cache_length, state.index) == (length, index) and state.lengths[1] == 25
    _, after = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    _, (fresh,) = sampler.generate(sampler.prefill([list(range(5, 30))]), jax.random.PRNGKey(0),
                                   max_new_tokens=6, params=GREEDY)
    assert after[1].tokens.tolist() == fresh.tokens.tolist()
    np.testing.assert_allclose(after[1].logprobs, fresh.logprobs, atol=1e-5)


def test_insert_after_a_compaction_that_leaves_too_few_slots_grows_the_cache(model):
    """A long row cleared leaves the index far above what the rows hold: making room for a long
    prompt compacts first (the index drops to 9), which leaves fewer slots than the prompt needs;
    the cache then grows instead of reporting itself full."""
    small = Sampler(model, min_cache_length=16, min_extend_length=16)
    state = small.prefill([list(range(10, 50)), list(range(60, 70))])  # index 39 of 48 slots
    state = small.clear(state, [0])
    prompt = list(range(100, 150))  # 64 slots
    state = small.insert(state, [0], [prompt])
    assert state.cache_length >= 64
    _, after = small.generate(state, jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    _, fresh = small.generate(small.prefill([prompt, list(range(60, 70))]), jax.random.PRNGKey(0),
                              max_new_tokens=6, params=GREEDY)
    assert [g.tokens.tolist() for g in after] == [g.tokens.tolist() for g in fresh]


def test_insert_into_a_full_cache_raises_and_leaves_the_state_intact(model):
    capped = Sampler(model, max_cache_length=64, min_cache_length=32)
    state = capped.prefill([list(range(10, 60)), [3, 4]])
    with pytest.raises(ContextOverflowError, match="insert: 96 cache slots needed, 64 in the cache"):
        capped.insert(state, [1], [list(range(5, 75))])
    _, gens = capped.generate(state, jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    _, ref = capped.generate(capped.prefill([list(range(10, 60)), [3, 4]]), jax.random.PRNGKey(0),
                             max_new_tokens=4, params=GREEDY)
    assert [g.tokens.tolist() for g in gens] == [g.tokens.tolist() for g in ref]


def test_appending_to_a_few_rows_computes_those_rows_only_with_the_same_results(model, sampler):
    prompts = PROMPTS + [[30, 31, 32]]
    state = sampler.prefill(prompts)
    state, gens = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=5, params=GREEDY)
    extends = []
    sampler_extend = sampler._extend_jit
    sampler._extend_jit = lambda *a, program: extends.append(program) or sampler_extend(*a, program=program)
    try:
        state = sampler.append(state, [[], [], [40, 41, 42], []])
    finally:
        sampler._extend_jit = sampler_extend
    assert [p.batch for p in extends] == [1]  # one row computed, not the batch of 4
    contexts = [p + g.tokens.tolist() for p, g in zip(prompts, gens)]
    contexts[2] += [40, 41, 42]
    assert state.lengths.tolist() == [len(c) for c in contexts]
    _, after = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    _, fresh = sampler.generate(sampler.prefill(contexts), jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    assert [g.tokens.tolist() for g in after] == [g.tokens.tolist() for g in fresh]
    np.testing.assert_allclose(after[2].logprobs, fresh[2].logprobs, atol=1e-5)


def test_appending_to_a_row_with_free_slots_below_the_index_takes_those(model, sampler):
    """A row restarted by `insert` has its old slots free below the new prompt: an observation
    appended to it alone goes there, so the cache neither grows nor moves its index (the other
    rows are not widened), and every row goes on as a fresh prefill of its context would."""
    prompts = [list(range(10, 90)), [3, 4], [5, 6, 7]]
    state, gens = sampler.generate(sampler.prefill(prompts), jax.random.PRNGKey(0), max_new_tokens=4, params=GREEDY)
    contexts = [p + g.tokens.tolist() for p, g in zip(prompts, gens)]
    state = sampler.insert(sampler.clear(state, [1]), [1], [[20, 21, 22, 23, 24]])
    contexts[1] = [20, 21, 22, 23, 24]
    assert state.free_slots()[1] >= 16
    length, index = state.cache_length, state.index
    state = sampler.append(state, [[], list(range(30, 40)), []])
    contexts[1] += list(range(30, 40))
    assert (state.cache_length, state.index) == (length, index)
    _, after = sampler.generate(state, jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    _, fresh = sampler.generate(sampler.prefill(contexts), jax.random.PRNGKey(0), max_new_tokens=6, params=GREEDY)
    assert [g.tokens.tolist() for g in after] == [g.tokens.tolist() for g in fresh]
    np.testing.assert_allclose(after[1].logprobs, fresh[1].logprobs, atol=1e-5)


def test_insert_with_a_kept_prefix_equals_a_plain_insert(model, sampler):
    shared = [50, 51, 52, 53, 54, 55]
    prefix = (shared, sampler.prefill([shared]))
    results = []
    for use in (None, prefix, prefix):  # the prefix state is reusable
        state = sampler.prefill(PROMPTS)
        state, _ = sampler.generate(state, jax.random.PRNGKey(1), max_new_tokens=4, params=GREEDY)
        state = sampler.insert(state, [0, 2], [shared + [7, 8], shared + [9]], prefix=use)
        _, gens = sampler.generate(state, jax.random.PRNGKey(1), max_new_tokens=8, params=GREEDY)
        results.append(gens)
    for gens in results[1:]:
        assert [g.tokens.tolist() for g in gens] == [g.tokens.tolist() for g in results[0]]
        np.testing.assert_allclose(gens[0].logprobs, results[0][0].logprobs, atol=1e-5)


@pytest.mark.parametrize("block", [256, 7])
def test_drawn_tokens_follow_the_softmax_and_never_a_cut_candidate(block):
    """`draw_tokens` (inverse CDF, one uniform per row) against softmax(z): 200,000 draws of one
    row; every candidate's count within 5 standard deviations of its expectation, no draw of a
    -inf candidate (first, last, and whole blocks of them included)."""
    from steprl_jax.sampling.sampler import draw_tokens

    rng = np.random.default_rng(0)
    C, draws = 1000, 200_000
    z = rng.normal(0.0, 2.0, C).astype(np.float32)
    cut = np.zeros(C, bool)
    cut[[0, 1, C - 1]] = True
    cut[300:520] = True  # whole blocks at either size
    cut[rng.choice(C, 100, replace=False)] = True
    z[cut] = -np.inf
    p = np.exp(z - z[~cut].max())
    p /= p.sum()
    keys = jax.random.split(jax.random.PRNGKey(3), draws)
    tokens = np.asarray(jax.jit(draw_tokens, static_argnums=2)(keys, jnp.broadcast_to(jnp.asarray(z), (draws, C)),
                                                               block))
    assert not cut[tokens].any()
    counts = np.bincount(tokens, minlength=C)
    expected = draws * p
    sigma = np.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1), np.max(np.abs(counts - expected) / (sigma + 1e-9))
    # a row with a single positive candidate always draws it, at a block's edges too
    one = np.full((4, C), -np.inf, np.float32)
    one[np.arange(4), [0, 255, 256, C - 1]] = 0.0
    assert np.asarray(draw_tokens(keys[:4], jnp.asarray(one), block)).tolist() == [0, 255, 256, C - 1]


def test_tiny_differences_in_the_logits_seldom_change_a_draw():
    """A flat row over SmolLM2's 49,152 candidates (a random policy's), drawn again with every
    logit off by ~1e-5 (what another batch size or device count may give): the two draws agree
    for nearly every key. Drawing the block's candidate from what was left of one uniform
    (u * total - the blocks before, float32 steps of 4e-3 against candidates of mass ~1) moved
    2 of these 1,024 draws (22 of 8,192 over more keys) to a neighbour; multi-process rollouts
    then differed from one process's (tests/test_multihost.py)."""
    from steprl_jax.sampling.sampler import draw_tokens

    rng = np.random.default_rng(0)
    rows, C = 1024, 49_152
    z = rng.normal(0.0, 0.05, C).astype(np.float32)
    off = (z + rng.normal(0.0, 1e-5, C)).astype(np.float32)
    keys = jax.random.split(jax.random.PRNGKey(7), rows)
    draw = jax.jit(draw_tokens)
    first = np.asarray(draw(keys, jnp.broadcast_to(jnp.asarray(z), (rows, C))))
    second = np.asarray(draw(keys, jnp.broadcast_to(jnp.asarray(off), (rows, C))))
    assert (first != second).sum() <= 1, np.flatnonzero(first != second)
