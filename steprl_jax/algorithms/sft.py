"""SFT (SWiRL's baseline; PORTool's warm start): next-token loss on the action tokens of units.

The units of one trajectory are prefixes of each other (causal attention), so all of them are
trained in ONE row, the trajectory, with loss on the kept actions' tokens: the same loss and
gradient as one row per unit (token_mean), each state computed once.
"""
from __future__ import annotations

from typing import Sequence

from steprl_jax.data.units import Unit
from steprl_jax.training.config import LossConfig
from steprl_jax.training.pack import Row, Span

LOSS = LossConfig(kind="sft", agg="token_mean")


def group_by_trajectory(units: Sequence[Unit]) -> list[list[Unit]]:
    """Units grouped by trajectory (first-seen order), each group in step order."""
    groups: dict = {}
    for unit in units:
        groups.setdefault(unit.trajectory_id, []).append(unit)
    return [sorted(g, key=lambda u: u.step_index) for g in groups.values()]


def trajectory_row(units: Sequence[Unit]) -> list[Row]:
    """One row for a trajectory's kept units (loss on their actions); if the units are not
    prefixes of one sequence (they always are for records of one trajectory), one row each."""
    last = units[-1]
    full = list(last.state_ids) + list(last.action_ids)
    spans, cursor = [], 0
    for unit in units:
        start, end = len(unit.state_ids), len(unit.state_ids) + len(unit.action_ids)
        if start < cursor or full[:start] != list(unit.state_ids) or full[start:end] != list(unit.action_ids):
            return [Row([Span(u.state_ids), Span(u.action_ids, loss=True)]) for u in units]
        if start > cursor:
            spans.append(Span(full[cursor:start]))
        spans.append(Span(full[start:end], loss=True))
        cursor = end
    return [Row(spans)]


def sft_rows(groups: Sequence[Sequence[Unit]]) -> list[Row]:
    return [row for group in groups for row in trajectory_row(group)]
