"""SFT (SWiRL's baseline; PORTool's warm start): next-token loss on the action tokens of units.

The units of one trajectory are prefixes of each other (causal attention), so all of them are
trained in ONE row, the trajectory, with loss on the kept actions' tokens: the same loss and
gradient as one row per unit (token_mean), each state computed once.

The online methods' warm start trains on expert demonstrations instead (`expert_rows`): one row
per task (a tool-world query's reference plan, a math problem's gold steps), laid out token for
token as a rollout of the same environment would see it (`demonstration_row`).
"""
from __future__ import annotations

from typing import Sequence

from steprl_jax.agents.environments import Task
from steprl_jax.data.demonstrations import Demonstration
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


def demonstration_row(env, tokenizer, task: Task, demonstration: Demonstration) -> Row:
    """The row of an expert demonstration of `task` in `env` (any action format), token-exact.

    Prompt: the ids `RolloutEngine.prompt(task)` gives (the env's messages and tool rendering,
    through `chat.apply_chat`, which tokenises its text the same way). Then per step the action
    text encoded without special tokens (loss) and, after a tool step, the observation ids as the
    env appends them (`env.observation_ids`, the turn-closing and turn-opening tokens included;
    no loss). An action that ends its turn is followed by the end-of-turn token (loss: the policy
    samples it); after any other last action nothing follows (a rollout cuts it at the stop string)."""
    from steprl_jax.models.chat import apply_chat, end_of_turn_id

    spans = [Span(apply_chat(tokenizer, env.messages(task), tools=env.tool_schemas(task)))]
    for step in demonstration.steps:
        action = tokenizer.encode(step.action, add_special_tokens=False)
        spans.append(Span(action + [end_of_turn_id(tokenizer)] if step.ends_turn else action, loss=True))
        if step.observation:
            spans.append(Span(env.observation_ids(tokenizer, step.observation)))
    return Row(spans)


def expert_rows(config, tokenizer, split: str = "train", local_model=None) -> list[Row]:
    """One SFT row per task of the suite of `config` (`agents.tasks.build_suite(config, split)`, so
    `task.offset`/`task.num_tasks` select them) that has an expert demonstration in the suite's
    format (`TaskSuite.demonstrate`): the tool world's reference plans (think + tool_call, results cut
    as the rollout cuts them), the math tasks' gold steps (tag and code formats; a GSM8K step that is
    not plain arithmetic leaves its problem out). The prompt is the rollout's: with `env.few_shot > 0`
    it holds the worked examples too. `local_model`: as `build_suite` takes it."""
    from steprl_jax.agents.tasks import build_suite

    suite = build_suite(config, split, local_model=local_model)
    if suite.demonstrate is None:
        raise ValueError(f"expert_rows: task.name={config.task.name!r} in env.format={config.env.format!r} has no "
                         f"expert demonstrations (the tool world; the math tasks in the tags, code and "
                         f"code_turns formats)")
    rows = []
    for task in suite.tasks:
        demonstration = suite.demonstrate(task)
        if demonstration is None:
            continue
        try:
            rows.append(demonstration_row(suite.env, tokenizer, task, demonstration))
        finally:
            suite.env.release(task)  # a tool world task's registry, opened for its schemas
    if not rows:
        raise ValueError(f"expert_rows: none of the {len(suite.tasks)} tasks of {config.task.name!r} has an "
                         f"expert demonstration")
    return rows
