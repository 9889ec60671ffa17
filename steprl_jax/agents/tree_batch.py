"""A rollout tree record -> packed trajectory rows + the arrays `tree_advantages` takes.

Each leaf's root-to-leaf path becomes one row: prompt ids, then each step's action ids and
observation ids, exactly as sampled and appended. A step shared by several trajectories
has one span per row that contains it; its advantage is computed once per node and
scattered onto all of those spans (observation tokens get none).
"""
from __future__ import annotations

from steprl_jax.agents.formats import passed_fraction
from steprl_jax.agents.records import TreeRecord
from steprl_jax.ops.tree_arrays import ArrayTreeNode, RolloutTree


def tree_rows(record: TreeRecord, first_row: int = 0) -> tuple[RolloutTree, list[list[int]]]:
    """(RolloutTree with spans into the rows, token ids of each row); rows start at `first_row`.

    Leaf outcomes come from `record.leaf_outcomes` (a missing verdict is an error: judge first);
    `fm_reward` is 2 * passed_fraction - 1 of the step's formatting checks (0 without checks).
    """
    nodes = [ArrayTreeNode(parent=n.parent,
                           fm_reward=(2 * passed_fraction(n.step.format_checks) - 1) if n.step.format_checks else 0.0)
             for n in record.nodes]
    rows = []
    for r, leaf in enumerate(record.leaves()):
        key = str(leaf)
        if key not in record.leaf_outcomes or record.leaf_outcomes[key] is None:
            raise ValueError(f"tree {record.id}: leaf {leaf} has no outcome (judge the tree first)")
        nodes[leaf].leaf_outcome = float(record.leaf_outcomes[key])
        ids = list(record.prompt_ids)
        for index in record.path(leaf):
            step = record.nodes[index].step
            nodes[index].spans.append((first_row + r, len(ids), len(ids) + len(step.action_ids)))
            ids += step.action_ids + step.observation_ids
        rows.append(ids)
    return RolloutTree(nodes=nodes), rows
