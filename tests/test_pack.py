"""The row packer: a shared prefix with G branches in one row computes exactly what G separate
rows compute (log-probs, loss and gradients); spans land on their tokens; shapes are bucketed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from steprl_jax.models import ModelConfig, Transformer, attention
from steprl_jax.training.config import LossConfig, TrainStepConfig
from steprl_jax.training.forward import sequence_logprobs
from steprl_jax.models.attention import KEY_BLOCK, query_block
from steprl_jax.training.pack import (Row, Span, attended_keys, cheapest_layout, layout_cost, pack, regroup, row_length,
                                      share_prefix)
from steprl_jax.training.step import make_loss_and_grad

CFG = ModelConfig.tiny(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16)


def _groups(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n_state, lens in ((9, (3, 5, 1)), (4, (6, 2, 4))):
        state = rng.integers(1, CFG.vocab_size, n_state).tolist()
        actions = [rng.integers(1, CFG.vocab_size, k).tolist() for k in lens]
        logps = [(-2.0 + 0.1 * rng.normal(size=len(a))).tolist() for a in actions]
        advs = rng.normal(size=len(actions)).tolist()
        out.append((state, actions, logps, advs))
    return out


def _shared_rows(groups):
    return [Row([Span(s)], [[Span(a, loss=True, logprobs=lp, advantage=ad)]
                            for a, lp, ad in zip(acts, lps, advs)]) for s, acts, lps, advs in groups]


def _flat_rows(groups):
    return [Row([Span(s), Span(a, loss=True, logprobs=lp, advantage=ad)])
            for s, acts, lps, advs in groups for a, lp, ad in zip(acts, lps, advs)]


def _logps(model, batch):
    """Per-token log-probs of a packed batch (tree layout included)."""
    return np.asarray(sequence_logprobs(model, jnp.asarray(batch.tokens), attention_mask_bt=batch.attention_mask,
                                        positions_bt=batch.positions, branch_ids_bt=batch.branch_ids,
                                        branch_ends_bt=batch.branch_ends))


def _assert_same_loss_and_grads(model, a, b, loss: LossConfig):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = make_loss_and_grad(graphdef, TrainStepConfig(loss=loss, remat=None))
    la, ga, _ = fn(params, rest, jax.tree.map(jnp.asarray, a))
    lb, gb, _ = fn(params, rest, jax.tree.map(jnp.asarray, b))
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6), ga, gb)


def test_layout_puts_every_span_on_its_tokens():
    state, actions = [5, 6, 7], [[10, 11], [12]]
    batch = pack([Row([Span(state)], [[Span(a, loss=True, logprobs=[-1.0] * len(a), advantage=2.0 + g)]
                                     for g, a in enumerate(actions)])], min_length=1)
    # prefix[:-1] | last, a_1 | last, a_2
    assert batch.tokens[0, :7].tolist() == [5, 6, 7, 10, 11, 7, 12]
    assert batch.positions[0, :7].tolist() == [0, 1, 2, 3, 4, 2, 3]
    assert batch.branch_ids[0, :7].tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert batch.loss_mask[0, :7].tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert batch.advantages[0, :7].tolist() == [0, 0, 0, 2, 2, 0, 3]
    assert batch.old_logp[0, :7].tolist() == [0, 0, 0, -1, -1, 0, -1]
    assert batch.attention_mask[0].sum() == 7


def test_shapes_are_bucketed_and_rows_padded():
    batch = pack(_flat_rows(_groups()), num_microbatches=4, min_length=16)
    assert batch.tokens.shape[0] % 4 == 0 and batch.tokens.shape[0] >= 6
    assert batch.tokens.shape[1] == 16
    assert batch.attention_mask[6:].sum() == 0 and batch.loss_mask[6:].sum() == 0
    with pytest.raises(ValueError, match="max_length"):
        pack(_flat_rows(_groups()), max_length=8)


def test_shared_prefix_rows_equal_separate_rows():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    groups = _groups()
    shared, flat = pack(_shared_rows(groups)), pack(_flat_rows(groups))
    got = _logps(model, shared)[shared.loss_mask > 0]
    want = _logps(model, flat)[flat.loss_mask > 0]
    # Same tokens in the same order (group by group, action by action).
    assert np.array_equal(shared.tokens[shared.loss_mask > 0], flat.tokens[flat.loss_mask > 0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # token_mean: the same tokens and the same denominator in both layouts, so the same loss and grads.
    _assert_same_loss_and_grads(model, shared, flat, LossConfig(agg="token_mean"))


def test_share_prefix_merges_rows_of_one_start_and_keeps_the_loss():
    rng = np.random.default_rng(3)
    system = rng.integers(1, CFG.vocab_size, 12).tolist()
    rows = []
    for n_user, n_action, n_obs in ((3, 4, 2), (5, 2, 3), (2, 6, 1)):
        prompt = system + rng.integers(1, CFG.vocab_size, n_user).tolist()
        rows.append(Row([Span(prompt), Span(rng.integers(1, CFG.vocab_size, n_action).tolist(), loss=True),
                         Span(rng.integers(1, CFG.vocab_size, n_obs).tolist()),
                         Span(rng.integers(1, CFG.vocab_size, 2).tolist(), loss=True)]))
    shared = share_prefix(rows)
    assert len(shared) == 1 and len(shared[0].branches) == 3 and len(shared[0]) < sum(len(r) for r in rows)
    assert len(share_prefix(rows, max_tokens=40)) == 2  # split to fit
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    a, b = pack(shared), pack(rows)
    assert np.array_equal(a.tokens[a.loss_mask > 0], b.tokens[b.loss_mask > 0])
    np.testing.assert_allclose(_logps(model, a)[a.loss_mask > 0], _logps(model, b)[b.loss_mask > 0],
                               rtol=1e-5, atol=1e-5)
    assert share_prefix([rows[0]]) == [rows[0]]  # nothing to share


def _fan(prompt_len, branch_lens, seed=0):
    rng = np.random.default_rng(seed)
    return Row([Span(rng.integers(1, CFG.vocab_size, prompt_len).tolist())],
               [[Span(rng.integers(1, CFG.vocab_size, k).tolist(), loss=True, advantage=float(i))]
                for i, k in enumerate(branch_lens)])


def test_regroup_splits_branches_and_keeps_every_loss_token():
    row = _fan(10, (5, 7, 3, 9))
    assert [len(r.branches) for r in regroup([row], 0)] == [1, 1, 1, 1]  # one branch per row
    parts = regroup([row], 25)  # prefix 10 - 1 + (1 + branch) each: 6 + 8 | 4 + 10
    assert [len(r.branches) for r in parts] == [2, 2] and all(len(r) <= 25 for r in parts)
    assert regroup([row], 10_000) == [row]
    for layout in (regroup([row], 0), parts):
        a, b = pack(layout), pack([row])
        assert np.array_equal(a.tokens[a.loss_mask > 0], b.tokens[b.loss_mask > 0])
        assert np.array_equal(a.advantages[a.loss_mask > 0], b.advantages[b.loss_mask > 0])


def test_rows_are_padded_to_two_lengths_an_octave_up_to_1024_then_eight():
    assert [row_length(n) for n in (1, 65, 100, 700, 867, 1024)] == [64, 96, 128, 768, 1024, 1024]
    assert [row_length(n) for n in (1025, 1112, 2048, 2049, 3100, 4097)] == [1152, 1152, 2048, 2560, 3584, 4608]
    for n in (1100, 1900, 2100, 3000, 5000, 9000):  # key blocks need the query block to divide the row
        length = row_length(n)
        assert length - n < max(length / 8, 512) and length % query_block(length) == 0 and query_block(length) % KEY_BLOCK == 0
    assert pack([_fan(100, [95] * 12)]).tokens.shape == (1, 1280)  # 1,251 tokens


def test_cheapest_layout_follows_the_attention_cost():
    # A prompt-heavy fan: 8 completions of 95 tokens behind a 100-token prompt. Packed, one
    # 867-token row (1,024 padded) whose queries attend over one path (195 keys, plus a query
    # block that may straddle two branches); flat, 8 rows of 195 (256 padded), twice the tokens.
    # Packed wins whatever attention costs.
    row = _fan(100, [95] * 8)
    flat = regroup([row], 0)
    cost = lambda rows, att: layout_cost(rows, attention_length=att)  # noqa: E731
    for att in (1e9, 256):
        assert cheapest_layout([row], attention_length=att) == [row]
    assert attended_keys(row) == 195 + 128 and attended_keys(flat[0]) == len(flat[0]) == 195
    assert cost([row], 256) == 1024 * (1 + 323 / 256) < cost(flat, 256) == 8 * 256 * (1 + 195 / 256)
    # A completion-heavy fan: 8 x 400 tokens behind 10. Packed has the fewest tokens (3,217 ->
    # 3,584 against 8 x 512), the choice when attention is cheap; when it is dear, each query's
    # keys count (538 packed, 410 flat) and the flat rows win.
    wide = _fan(10, [400] * 8)
    assert cheapest_layout([wide], attention_length=1e9) == [wide]
    assert cheapest_layout([wide], attention_length=256) == regroup([wide], 0)
    assert cost([wide], 256) == 3584 * (1 + 538 / 256) > cost(regroup([wide], 0), 256) == 8 * 512 * (1 + 410 / 256)
    # Short actions behind a long shared state: packed.
    state = _fan(900, [8] * 8)
    assert cheapest_layout([state], attention_length=256) == [state]
    # rows without branches pass through; the micro-batch multiple counts padding rows
    assert cheapest_layout(flat, attention_length=256) == flat
    three = [Row([Span(list(range(1, 101)))])] * 3
    assert layout_cost(three, attention_length=1e9, num_microbatches=4) == 4 * 128 * (1 + 100 / 1e9)


def test_a_tree_row_equals_one_row_per_path():
    # prompt -> step a (action, observation) -> {b, step c (action, observation) -> {d, e}};
    # prompt -> f. Each shared step's tokens once, against one row per root-to-leaf path where a
    # shared step trains in its first path only (the same loss tokens and weights).
    rng = np.random.default_rng(7)
    ids = lambda k: rng.integers(1, CFG.vocab_size, k).tolist()
    act = lambda k, adv: Span(ids(k), loss=True, logprobs=(-1.0 - rng.random(k)).tolist(), advantage=adv,
                              weight=float(rng.integers(1, 4)))
    ctx = lambda span: Span(span.ids)
    prompt, a, oa, b, c, oc, d, e, f = (Span(ids(6)), act(3, 0.5), Span(ids(2)), act(4, -1.0), act(2, 0.3),
                                        Span(ids(3)), act(3, 1.5), act(5, -0.2), act(4, 0.7))
    tree = Row([prompt], [Row([a, oa], [[b], Row([c, oc], [[d], [e]])]), [f]])
    paths = [Row([prompt, a, oa, b]), Row([prompt, ctx(a), oa, c, oc, d]), Row([prompt, ctx(a), oa, ctx(c), oc, e]),
             Row([prompt, f])]
    flat_ids, _, _, _, positions, branch, ends = tree.flat()
    assert len(tree) == len(flat_ids) == 6 + 3 + 2 + (1 + 4) + (1 + 2 + 3 - 1) + (1 + 3) + (1 + 5) + (1 + 4) - 1
    assert branch == sorted(branch) and sorted(set(branch)) == list(range(7))  # 7 nodes in preorder
    node_end = dict(zip(branch, ends))
    assert node_end == {0: 7, 1: 6, 2: 3, 3: 6, 4: 5, 5: 6, 6: 7}
    # d's first token continues c's observation positions: 6 + 3 + 2 + 2 + 3 = 16
    assert positions[branch.index(4)] == 15 and positions[branch.index(4) + 1] == 16
    a_batch, b_batch = pack([tree]), pack(paths)
    assert a_batch.branch_ends is not None and b_batch.branch_ends is None
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    on_a, on_b = a_batch.loss_mask > 0, b_batch.loss_mask > 0
    assert np.array_equal(a_batch.tokens[on_a], b_batch.tokens[on_b])
    np.testing.assert_allclose(_logps(model, a_batch)[on_a], _logps(model, b_batch)[on_b], rtol=1e-5, atol=1e-5)
    # the clipped surrogate over the weighted tokens (token_mean over the weights): same loss, same grads
    _assert_same_loss_and_grads(model, a_batch, b_batch, LossConfig(kind="policy", agg="token_mean"))


def binary_tree(rng, vocab: int, levels: int = 4) -> Row:
    """A prompt of 100 tokens, then a binary tree of `levels` steps (an action of 20-40 tokens
    and an observation of 10-30): 30 steps, ~1,800 tokens at 4 levels."""
    ids = lambda k: rng.integers(1, vocab, k).tolist()  # noqa: E731

    def step(depth):
        k = int(rng.integers(20, 40))
        spans = [Span(ids(k), loss=True, logprobs=(-1.0 - rng.random(k)).tolist(), advantage=float(rng.normal())),
                 Span(ids(int(rng.integers(10, 30))))]
        return Row(spans, [step(depth + 1), step(depth + 1)]) if depth < levels - 1 else spans

    return Row([Span(ids(100))], [step(0), step(0)])


def test_a_long_tree_row_attends_over_the_key_blocks_it_sees_only():
    # A binary tree of 3 levels (14 steps of an action and an observation) behind a prompt: one
    # 768-token row (6 query blocks) whose queries see their ancestors only. Attention gathers the key blocks a
    # query block sees (`key_blocks`) instead of every block before it: the same log-probs, loss
    # and gradients.
    batch = pack([binary_tree(np.random.default_rng(3), CFG.vocab_size, levels=3)])
    T = batch.tokens.shape[1]
    assert T == 768 and batch.key_blocks is not None
    Q, M = batch.key_blocks.shape[1:]
    key_block = attention.KEY_BLOCK
    assert Q == T // attention.query_block(T) and M * key_block < T - T // Q  # the last blocks gather fewer keys
    valid, node, end = batch.attention_mask[0].astype(bool), batch.branch_ids[0], batch.branch_ends[0]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = (j <= i) & valid[None, :] & (node[None, :] <= node[:, None]) & (node[:, None] < end[None, :])
    for q in range(Q):  # every key block holding a key that a query of the block sees is gathered
        needed = set(np.nonzero(seen[q * T // Q:(q + 1) * T // Q].any(0))[0] // key_block)
        assert needed <= set(batch.key_blocks[0, q].tolist())
    model = Transformer(CFG, rngs=nnx.Rngs(2))
    plain = batch.replace(key_blocks=None)
    on = batch.loss_mask > 0
    gathered_logps = np.asarray(sequence_logprobs(
        model, jnp.asarray(batch.tokens), attention_mask_bt=batch.attention_mask, positions_bt=batch.positions,
        branch_ids_bt=batch.branch_ids, branch_ends_bt=batch.branch_ends, key_blocks_bqm=batch.key_blocks))
    np.testing.assert_allclose(gathered_logps[on], _logps(model, plain)[on], rtol=1e-5, atol=1e-5)
    _assert_same_loss_and_grads(model, batch, plain, LossConfig(kind="policy", agg="token_mean"))


def test_regroup_opens_a_tree_without_changing_its_loss():
    rng = np.random.default_rng(11)
    ids = lambda k: rng.integers(1, CFG.vocab_size, k).tolist()
    act = lambda k, adv, w: Span(ids(k), loss=True, logprobs=(-1.0 - rng.random(k)).tolist(), advantage=adv, weight=w)
    a, oa, c, oc = act(3, 0.5, 3.0), Span(ids(2)), act(2, 0.3, 2.0), Span(ids(3))
    tree = Row([Span(ids(6))], [Row([a, oa], [[act(4, -1.0, 1.0)], Row([c, oc], [[act(3, 1.5, 1.0)],
                                                                                   [act(5, -0.2, 1.0)]])]),
                                [act(4, 0.7, 1.0)]])
    def weighted(rows):
        b = pack(rows)
        on = b.loss_mask > 0
        return sorted(zip(b.tokens[on].tolist(), b.loss_mask[on].tolist(), b.advantages[on].tolist()))

    model = Transformer(CFG, rngs=nnx.Rngs(1))

    def token_logps(rows):
        b = pack(rows)
        lp = _logps(model, b)
        return sorted(zip(b.tokens[b.loss_mask > 0].tolist(), lp[b.loss_mask > 0].round(4).tolist()))

    for limit in (0, 12, 20, 30, 10_000):
        parts = regroup([tree], limit)
        assert weighted(parts) == weighted([tree])  # each trained token once, same weight and advantage
        assert token_logps(parts) == token_logps([tree])  # and the same context
        if limit == 0:
            assert len(parts) == 4 and all(not any(isinstance(b, Row) for b in p.branches) for p in parts)
        if limit == 10_000:
            assert parts == [tree]


def test_layout_guards():
    from steprl_jax.training.batch import validate_batch

    row = _fan(100, [95] * 8)
    batch = pack([row])
    validate_batch(batch)
    with pytest.raises(ValueError, match="branch_ends"):  # a nested tree's mask needs its ends
        validate_batch(batch.replace(branch_ends=None))
    # a layout longer than max_length is never chosen when a regrouped one fits
    chosen = cheapest_layout([row], attention_length=1e9, max_length=600)
    assert max(len(r) for r in chosen) <= 600
