"""Judged rollout trees -> packed training rows (training/pack.py), one advantage per step token.

The prompt is the shared prefix, each judged leaf's path a branch: its actions are loss spans
carrying their step's advantage and recorded log-probs, its observations (tool responses,
chat-template glue) are context without loss. The token weight of a span implements the
aggregation over the query's tokens:

    token_mean           weight 1: every generated token of the batch counts the same (DAPO)
    seq_mean_token_mean  1 / (loss tokens of the trajectory): a mean per trajectory (GRPO)
    query_token_mean     1 / (loss tokens of the query's trajectories): PORTool's per-query mean

and the train step divides the weighted sum by the sum of the weights (its `token_mean` kernel),
which is exact over any micro-batch split since the denominator is the whole batch's. A step
shared by several trajectories is trained once per trajectory through it (`per_trajectory`, the
paper's sum over trajectories) or only in the first one (`once`).
"""
from __future__ import annotations

from typing import Callable, Optional

from steprl_jax.agents.records import TreeRecord
from steprl_jax.training.pack import Row, Span

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "query_token_mean")
WEIGHTINGS = ("per_trajectory", "once")


def leaf_rows(record: TreeRecord, advantage: Callable[[int, int], float], *, agg: str = "query_token_mean",
              weighting: str = "per_trajectory", max_row_tokens: Optional[int] = None) -> list[Row]:
    """Packed rows of a judged tree: `advantage(leaf, node)` is the advantage of every token of
    step `node` on the path to `leaf` (PORTool: the node's; GRPO: the leaf's). Branches are
    grouped into rows of at most `max_row_tokens` tokens, each row repeating the prompt."""
    if agg not in LOSS_AGGS:
        raise ValueError(f"loss aggregation {agg!r} is not one of {LOSS_AGGS}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"token weighting {weighting!r} is not one of {WEIGHTINGS}")
    claimed: set = set()
    branches = []  # per leaf: list of (span kwargs) before weights are known
    for leaf in record.leaves():
        path = record.path(leaf)
        spans = []
        for i, node in enumerate(path):
            step = record.nodes[node].step
            trained = weighting == "per_trajectory" or node not in claimed
            claimed.add(node)
            if step.action_ids:
                spans.append(dict(ids=list(step.action_ids), loss=trained, logprobs=list(step.action_logprobs),
                                  advantage=float(advantage(leaf, node)) if trained else 0.0))
            if i + 1 < len(path) and step.observation_ids:  # the last observation feeds no trained token
                spans.append(dict(ids=list(step.observation_ids)))
        branches.append(spans)
    count = lambda spans: sum(len(s["ids"]) for s in spans if s.get("loss"))
    query_tokens = sum(count(b) for b in branches)
    out = []
    for spans in branches:
        weight = {"token_mean": 1.0, "seq_mean_token_mean": 1.0 / max(1, count(spans)),
                  "query_token_mean": 1.0 / max(1, query_tokens)}[agg]
        out.append([Span(**s, weight=weight) if s.get("loss") else Span(s["ids"]) for s in spans])
    return _rows(record.prompt_ids, [b for b in out if b], max_row_tokens)


def _rows(prompt_ids, branches, max_row_tokens) -> list[Row]:
    prompt = [Span(list(prompt_ids))]
    rows, current, length = [], [], len(prompt_ids)
    for branch in branches:
        size = 1 + sum(len(s.ids) for s in branch)
        if current and max_row_tokens is not None and length + size > max_row_tokens:
            rows.append(Row(prompt, current))
            current, length = [], len(prompt_ids)
        current.append(branch)
        length += size
    if current:
        rows.append(Row(prompt, current))
    return rows
