"""The one row packer every batch builder uses: token spans -> a fixed-shape `Batch`.

A row is a shared prefix (branch 0) and zero or more branches that continue it:

    Row(prefix=[Span(prompt), Span(a_1, loss=True, logprobs=...), Span(o_1), ...])   # SFT, a trajectory
    Row(prefix=[Span(state)], branches=[[Span(a_g, loss=True, logprobs=lp_g, advantage=A_g)]
                                        for g in range(G)])                           # SWiRL stage 2, GRPO

With branches, the row is laid out as `prefix[:-1] | prefix[-1] a_1 | prefix[-1] a_2 | ...`:
each branch starts with its own copy of the prefix's last token, at the prefix's last
position, and sees (branch ids, `Transformer.hidden_states`) the prefix and itself only. So
the usual next-token alignment holds inside every branch and the row computes exactly what G
rows `prefix + a_g` compute, with the prefix's tokens run once instead of G times.

A branch may itself be a `Row` (a sub-tree), so a rollout tree packs with every shared step's
tokens once (algorithms/tree_rows.py):

    Row([Span(prompt)], [Row([Span(a_1, loss=True, ...), Span(o_1)],
                             [[Span(a_2, loss=True, ...)], [Span(a_2', loss=True, ...)]]),
                         [Span(a_1'', loss=True, ...)]])

Branches are numbered in depth-first preorder; a token sees its own branch and its
ancestors (the interval test of `Transformer.hidden_states` on branch ids and ends).

Shapes are bounded: the row length is rounded up (`row_length`: two lengths an octave up to
1,024 tokens, four to eight above, where padding is dear), and
the number of rows to a multiple of micro-batches x data shards (and to `min_rows`) with
empty padding rows, so a run compiles a handful of train-step programs.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np

from steprl_jax.models.attention import CAUSAL_QUERY_BLOCK, key_block_table
from steprl_jax.shapes import bucket
from steprl_jax.training.batch import Batch, make_batch


@dataclasses.dataclass(frozen=True)
class Span:
    """Consecutive tokens of one kind. `loss`: trained tokens (an action); `logprobs`: the
    log-probs they were sampled with (one per token; required for policy losses); `advantage`:
    one value for every token of the span; `weight`: the loss weight of each of its tokens (the
    batch's loss mask value; the token_mean kernel divides by the sum of the weights, so weights
    implement per-trajectory or per-query means, algorithms/tree_rows.py)."""

    ids: Sequence[int]
    loss: bool = False
    logprobs: Optional[Sequence[float]] = None
    advantage: float = 0.0
    weight: float = 1.0

    def __post_init__(self):
        if self.logprobs is not None and len(self.logprobs) != len(self.ids):
            raise ValueError(f"a span of {len(self.ids)} tokens has {len(self.logprobs)} log-probs")
        if not self.weight > 0:
            raise ValueError(f"a span's loss weight must be > 0, got {self.weight}")


@dataclasses.dataclass(frozen=True)
class Row:
    """A tree of token spans laid out in one row: `prefix`, then each branch continuing it. A
    branch is a list of spans (a leaf) or a `Row` (a sub-tree: its prefix continues this one's,
    its branches fork after it). A node with branches must end in a non-loss span (its last
    token is copied to the head of every branch)."""

    prefix: Sequence[Span]
    branches: Sequence = ()

    def flat(self):
        """(ids, loss, logprobs, advantages, positions, branch ids, branch ends) as lists, in
        row order: branches numbered in depth-first preorder, each branch's end one past the last
        number of its subtree (`Transformer.hidden_states`)."""
        out = ([], [], [], [], [], [])
        ends: dict = {}

        def put(span: Span, branch: int, start_pos: int, ids=None):
            ids = list(span.ids if ids is None else ids)
            lp = list(span.logprobs) if span.logprobs is not None else [0.0] * len(ids)
            out[0].extend(ids)
            out[1].extend([float(span.loss) * float(span.weight)] * len(ids))
            out[2].extend(lp[:len(ids)])
            out[3].extend([float(span.advantage) if span.loss else 0.0] * len(ids))
            out[4].extend(range(start_pos, start_pos + len(ids)))
            out[5].extend([branch] * len(ids))
            return start_pos + len(ids)

        def lay(spans, branches, pos: int, carry) -> None:
            node = len(ends)
            ends[node] = None
            if carry is not None:  # the parent's last token, at the parent's last position
                pos = put(Span([carry]), node, pos)
            spans = [s for s in spans if len(s.ids)]
            if not branches:
                for span in spans:
                    pos = put(span, node, pos)
            else:
                if not spans or spans[-1].loss:
                    raise ValueError("a row with branches needs a prefix that ends in a non-loss span")
                for span in spans[:-1]:
                    pos = put(span, node, pos)
                pos = put(spans[-1], node, pos, ids=list(spans[-1].ids)[:-1])
                last = spans[-1].ids[-1]
                for branch in branches:
                    if isinstance(branch, Row):
                        lay(branch.prefix, branch.branches, pos, last)
                    else:
                        lay(branch, (), pos, last)
            ends[node] = len(ends)

        if not any(len(s.ids) for s in self.prefix):
            raise ValueError("a row needs a non-empty prefix")
        lay(self.prefix, self.branches, 0, None)
        return (*out, [ends[b] for b in out[5]])

    def __len__(self) -> int:
        """Tokens of the row's layout (without building it)."""
        return _size(self.prefix, self.branches, child=False)


def _size(spans, branches, *, child: bool) -> int:
    """Tokens a node takes in the layout: a child's head copy, its own tokens less the last one
    when it has branches (they copy it), and its branches'."""
    own = sum(len(s.ids) for s in spans) + int(child) - int(bool(branches))
    return own + sum(branch_size(b) for b in branches)


def branch_size(branch) -> int:
    """Tokens a branch (a span list or a sub-tree `Row`) adds to its parent's row."""
    if isinstance(branch, Row):
        return _size(branch.prefix, branch.branches, child=True)
    return _size(branch, (), child=True)


def share_prefix(rows: Sequence[Row], max_tokens: Optional[int] = None) -> list[Row]:
    """Rows without branches whose first spans start alike (SFT rows of one system prompt and tool
    list, say) merged into rows of at most `max_tokens`: the common start once as the prefix, each
    row's remainder a branch. The same loss tokens with the same context, computed once."""
    if not rows or any(row.branches for row in rows) or any(row.prefix[0].loss for row in rows):
        return list(rows)
    first = [list(row.prefix[0].ids) for row in rows]
    common = first[0]
    for ids in first[1:]:
        k = 0
        while k < min(len(common), len(ids)) and common[k] == ids[k]:
            k += 1
        common = common[:k]
    if len(common) < 2 or len(rows) == 1:
        return list(rows)
    k = len(common) - 1  # each branch starts with a copy of the prefix's last token: keep one apart
    merged = Row([Span(common[:k])], [[Span(ids[k:]), *row.prefix[1:]] for row, ids in zip(rows, first)])
    return [merged] if max_tokens is None else regroup([merged], max_tokens)


def regroup(rows: Sequence[Row], max_tokens: int) -> list[Row]:
    """Each row with branches split into rows of at most `max_tokens` where it can be (0: one
    root-to-leaf path per row): the root's branches are grouped in order, and a sub-tree too
    long to fit one row is opened into its children, each carrying the sub-tree's own spans.
    A repeated span trains in its first copy only (the others are context), so the loss tokens,
    their weights and their context are unchanged: only how many tokens are run, and how long
    the rows are, changes."""
    out = []
    for row in rows:
        if not row.branches:
            out.append(row)
            continue
        prefix = sum(len(s.ids) for s in row.prefix) - 1  # its last token moves to the branches
        queue, current, length, parts = collections.deque(row.branches), [], prefix, 0
        while queue:
            branch = queue.popleft()
            size = branch_size(branch)
            if prefix + size > max_tokens and isinstance(branch, Row) and branch.branches:
                queue.extendleft(reversed(_open(branch)))
                continue
            if current and length + size > max_tokens:
                out.append(Row(row.prefix if not parts else _context(row.prefix), current))
                current, length, parts = [], prefix, parts + 1
            current.append(branch)
            length += size
        out.append(Row(row.prefix if not parts else _context(row.prefix), current))
    return out


def _context(spans) -> list[Span]:
    return [Span(s.ids) if s.loss else s for s in spans]


def _open(branch: Row) -> list:
    """A sub-tree as its children, each prefixed by the sub-tree's own spans (trained in the
    first child only)."""
    out = []
    for i, child in enumerate(branch.branches):
        own = list(branch.prefix) if i == 0 else _context(branch.prefix)
        out.append(Row(own + list(child.prefix), child.branches) if isinstance(child, Row) else own + list(child))
    return out


def row_length(n: int, minimum: int = 64) -> int:
    """The padded length of a row of `n` tokens: `bucket` up to 1,024 (two lengths an octave);
    above, where rows are dear, the next multiple of an eighth of the octave (at most 12.5%
    padding), but of 512 tokens at least beyond 2,048: the row must be a multiple of
    `causal_attention`'s query block (a sixteenth of the row there), itself of whole key
    blocks, for packed tree rows to gather key blocks."""
    n = max(int(n), int(minimum), 1)
    if n <= 1024:
        return bucket(n, minimum)
    step = max(1 << ((n - 1).bit_length() - 4), 128 if n <= 2048 else 512)
    return -(-n // step) * step


def attended_keys(row: Row) -> int:
    """Keys a query of `row` attends over, about: the row's length without branches; with
    branches (gathered key blocks, `models.attention.key_block_table`) its longest root-to-leaf
    path plus a query block, since a block of queries may straddle two branches."""
    if not row.branches:
        return len(row)
    return min(len(row), _longest_path(row.prefix, row.branches) + CAUSAL_QUERY_BLOCK)


def _longest_path(spans, branches) -> int:
    own = sum(len(s.ids) for s in spans)
    return own + max((_longest_path(b.prefix, b.branches) if isinstance(b, Row) else sum(len(s.ids) for s in b)
                      for b in branches), default=0)


def layout_cost(rows: Sequence[Row], *, attention_length: float, num_microbatches: int = 1,
                num_data_shards: int = 1, min_rows: int = 0, min_length: int = 64) -> float:
    """Estimated train-step cost of packing `rows`: padded rows x padded length x (1 + keys /
    attention_length), where keys are the keys a query attends over (`attended_keys`) and
    `attention_length` is the number of keys at which a token's attention costs as much as the
    rest of its forward and backward."""
    length = row_length(max(len(r) for r in rows), min_length)
    keys = max(attended_keys(r) for r in rows)  # <= the longest row <= length
    multiple = num_microbatches * num_data_shards
    n = -(-max(len(rows), min_rows) // multiple) * multiple
    return n * length * (1.0 + keys / attention_length)


def cheapest_layout(rows: Sequence[Row], *, attention_length: float, num_microbatches: int = 1,
                    num_data_shards: int = 1, min_rows: int = 0, min_length: int = 64,
                    max_length: Optional[int] = None) -> list[Row]:
    """`rows` regrouped (`regroup`) to the layout of least `layout_cost`: packing many branches
    behind one prefix runs the prefix once but makes long rows (whose attention, with gathered
    key blocks, grows with the longest path rather than the row); one branch per row repeats
    the prefix but keeps rows short."""
    rows = list(rows)
    if not any(row.branches for row in rows):
        return rows
    longest = max(len(row) for row in rows)
    limits, limit = [0], bucket(1, min_length)
    while limit < longest:
        limits.append(limit)
        limit = bucket(limit + 1)
    def cost(layout):
        if max_length is not None and max(len(r) for r in layout) > max_length:
            return float("inf")  # pack would refuse it
        return layout_cost(layout, attention_length=attention_length, num_microbatches=num_microbatches,
                           num_data_shards=num_data_shards, min_rows=min_rows, min_length=min_length)
    best, best_cost = rows, cost(rows)
    for limit in limits:  # (0: one path per row)
        layout = regroup(rows, limit)
        c = cost(layout)
        if c < best_cost:
            best, best_cost = layout, c
    return best


def pack(rows: Sequence[Row], *, num_microbatches: int = 1, num_data_shards: int = 1,
         min_rows: int = 0, min_length: int = 64, max_length: Optional[int] = None,
         pad_id: int = 0) -> Batch:
    """A `Batch` of NumPy arrays with one packed row per `Row` (plus padding rows).

    A row longer than `max_length` is an error naming it (the caller chose the context).
    """
    if not rows:
        raise ValueError("pack: no rows")
    flats = [row.flat() for row in rows]
    longest = max(len(f[0]) for f in flats)
    if max_length is not None and longest > max_length:
        worst = max(range(len(flats)), key=lambda i: len(flats[i][0]))
        raise ValueError(f"pack: row {worst} has {longest} tokens, more than max_length {max_length}")
    length = row_length(longest, min_length)
    multiple = num_microbatches * num_data_shards
    n = -(-max(len(rows), min_rows) // multiple) * multiple
    tokens = np.full((n, length), pad_id, np.int32)
    attention = np.zeros((n, length), np.int32)
    loss = np.zeros((n, length), np.float32)
    logp = np.zeros((n, length), np.float32)
    adv = np.zeros((n, length), np.float32)
    positions = np.zeros((n, length), np.int32)
    branches = np.zeros((n, length), np.int32)
    ends = np.zeros((n, length), np.int32)  # padding: end 0, seen by nothing
    for r, (ids, lm, lp, ad, pos, br, en) in enumerate(flats):
        k = len(ids)
        tokens[r, :k], attention[r, :k], loss[r, :k] = ids, 1, lm
        logp[r, :k], adv[r, :k], positions[r, :k], branches[r, :k], ends[r, :k] = lp, ad, pos, br, en
        positions[r, k:] = pos[-1] + 1 + np.arange(length - k)  # padding: past the row's tokens
    loss[:, 0] = 0.0  # column 0 has no prediction
    shared = any(row.branches for row in rows)
    if not shared:
        return make_batch(tokens, loss, adv, logp, attention_mask=attention)
    return make_batch(tokens, loss, adv, logp, attention_mask=attention, positions=positions, branch_ids=branches,
                      branch_ends=ends, key_blocks=key_block_table(attention, branches, ends))
