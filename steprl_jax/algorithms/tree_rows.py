"""Judged rollout trees -> packed training rows (training/pack.py), one advantage per step token.

A tree packs as one row with every step's tokens once: the prompt is the root, each step a
branch of its parent (a sub-tree `Row` when it has children): its action is a loss span
carrying the step's advantage and recorded log-probs, its observation (tool response,
chat-template glue) context without loss. The token weight of a span implements the
aggregation over the query's tokens:

    token_mean           weight 1: every generated token of the batch counts the same (DAPO)
    seq_mean_token_mean  1 / (loss tokens of the trajectory): a mean per trajectory (GRPO)
    query_token_mean     1 / (loss tokens of the query's trajectories): PORTool's per-query mean

and the train step divides the weighted sum by the sum of the weights (its `token_mean` kernel),
which is exact over any micro-batch split since the denominator is the whole batch's. A step
shared by several trajectories is trained once per trajectory through it (`per_trajectory`, the
paper's sum over trajectories: its tokens once, with the trajectories' weights summed, which is
the same loss since the per-token surrogate is the same for every copy) or only in the first
one (`once`). When a shared step's advantage differs between the trajectories through it
(GRPO's trajectory advantages on an ARPO tree), the surrogate is not linear in the advantage and
the tree packs as one branch per trajectory behind the prompt instead.
"""
from __future__ import annotations

from typing import Callable, Optional

from steprl_jax.agents.records import TreeRecord
from steprl_jax.training.pack import Row, Span, regroup

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "query_token_mean")
WEIGHTINGS = ("per_trajectory", "once")


def leaf_rows(record: TreeRecord, advantage: Callable[[int, int], float], *, agg: str = "query_token_mean",
              weighting: str = "per_trajectory", max_row_tokens: Optional[int] = None,
              masked: frozenset = frozenset()) -> list[Row]:
    """Packed rows of a judged tree: `advantage(leaf, node)` is the advantage of every token of
    step `node` on the path to `leaf` (PORTool: the node's; GRPO: the leaf's). A tree longer than
    `max_row_tokens` is split into rows (`pack.regroup`), each repeating the shared part it needs.
    `masked`: leaves whose trajectories train no token (context only; SimpleTIR's void turns)."""
    if agg not in LOSS_AGGS:
        raise ValueError(f"loss aggregation {agg!r} is not one of {LOSS_AGGS}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"token weighting {weighting!r} is not one of {WEIGHTINGS}")
    claimed: set = set()
    paths = []  # per leaf: [(node, action kwargs or None, observation ids or None)]
    for leaf in record.leaves():
        path = record.path(leaf)
        steps = []
        for i, node in enumerate(path):
            step = record.nodes[node].step
            trained = (weighting == "per_trajectory" or node not in claimed) and leaf not in masked
            if leaf not in masked:  # a masked trajectory leaves its shared steps to the others
                claimed.add(node)
            action = (dict(ids=list(step.action_ids), loss=trained, logprobs=list(step.action_logprobs),
                           advantage=float(advantage(leaf, node)) if trained else 0.0) if step.action_ids else None)
            # the last observation feeds no trained token
            observation = list(step.observation_ids) if i + 1 < len(path) and step.observation_ids else None
            steps.append((node, action, observation))
        paths.append(steps)
    count = lambda steps: sum(len(a["ids"]) for _, a, _ in steps if a and a["loss"])
    query_tokens = sum(count(p) for p in paths)
    weights = [{"token_mean": 1.0, "seq_mean_token_mean": 1.0 / max(1, count(p)),
                "query_token_mean": 1.0 / max(1, query_tokens)}[agg] for p in paths]
    root = _tree_row(record, paths, weights)
    if root is None:  # a shared step with leaf-dependent advantages: one branch per trajectory
        branches = [[s for _, a, o in p for s in _spans(a, o, w)] for p, w in zip(paths, weights)]
        root = Row([Span(list(record.prompt_ids))], [b for b in branches if b])
    if not root.branches:
        return []
    return regroup([root], max_row_tokens) if max_row_tokens else [root]


def _spans(action: Optional[dict], observation: Optional[list], weight: float) -> list[Span]:
    out = []
    if action:
        out.append(Span(**action, weight=weight) if action["loss"] else Span(action["ids"]))
    if observation:
        out.append(Span(observation))
    return out


def _tree_row(record: TreeRecord, paths, weights) -> Optional[Row]:
    """The tree as one nested `Row`, each step once, its trained copies' weights summed; None when
    a step's trained copies disagree on the advantage, or a step with children ends in a loss span."""
    copies: dict = {}  # node -> (action, observation, [(weight, advantage) of trained copies])
    children: dict = {}
    for steps, weight in zip(paths, weights):
        for k, (node, action, observation) in enumerate(steps):
            entry = copies.setdefault(node, (action, observation, []))
            if action and action["loss"]:
                entry[2].append((weight, action["advantage"]))
            parent = steps[k - 1][0] if k else -1
            if node not in children.setdefault(parent, []):
                children[parent].append(node)
    nodes = {}
    for node, (action, observation, trained) in copies.items():
        if len({a for _, a in trained}) > 1:
            return None
        if node in children and not observation:
            return None  # its children could not start from a copy of a context token
        if trained:
            action = dict(action, loss=True, advantage=trained[0][1])
            weight = sum(w for w, _ in trained)
        else:
            action, weight = (dict(action, loss=False) if action else None), 1.0
        nodes[node] = _spans(action, observation, weight)

    def branch(node):
        spans = nodes[node]
        if node in children:
            return Row(spans, [b for b in (branch(c) for c in children[node]) if _has_tokens(b)])
        return spans

    tops = [branch(c) for c in children.get(-1, [])]
    return Row([Span(list(record.prompt_ids))], [b for b in tops if _has_tokens(b)])


def _has_tokens(branch) -> bool:
    return isinstance(branch, Row) or bool(branch)
