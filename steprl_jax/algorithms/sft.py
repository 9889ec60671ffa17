"""SFT (SWiRL's baseline; PORTool's warm start): next-token loss on the action tokens of units.

The units of one trajectory are prefixes of each other (causal attention), so all of them are
trained in ONE row, the trajectory, with loss on the kept actions' tokens: the same loss and
gradient as one row per unit (token_mean), each state computed once.

PORTool's warm start trains on expert demonstrations instead (`expert_rows`): one row per
tool-world query, its reference plan laid out token for token as a rollout of the same
environment would see it (`demonstration_row`).
"""
from __future__ import annotations

from typing import Sequence

from steprl_jax.agents.environments import MAX_RESULT_CHARS, Task, clip_result
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
    """The row of an expert demonstration of `task` in `env` (either action format), token-exact.

    Prompt: the ids `RolloutEngine.prompt(task)` gives (the env's messages and tool rendering,
    through `chat.apply_chat`, which tokenises its text the same way). Then per step the action
    text encoded without special tokens (loss) and, after a tool step, the observation ids as the
    env appends them (`env.observation_ids`, the turn-closing and turn-opening tokens included;
    no loss). Nothing follows the last action: a rollout cuts actions at the stop string."""
    from steprl_jax.models.chat import apply_chat

    spans = [Span(apply_chat(tokenizer, env.messages(task), tools=env.tool_schemas(task)))]
    for step in demonstration.steps:
        spans.append(Span(tokenizer.encode(step.action, add_special_tokens=False), loss=True))
        if step.observation:
            spans.append(Span(env.observation_ids(tokenizer, step.observation)))
    return Row(spans)


def expert_rows(config, tokenizer, split: str = "train", *, max_result_chars: int | None = None) -> list[Row]:
    """One SFT row per query of the tool-world suite of `config` (`agents.tasks.build_suite(config,
    split)`, so `task.offset`/`task.num_tasks` select them): the query's reference plan as think +
    tool_call actions (`data.demonstrations.tool_call_demonstration`), the final one calling
    `response_gen`. The plan's calls are executed without injected failures and their results cut
    at `max_result_chars` (default `config.rollout.max_result_chars`) as the rollout cuts them. The prompt
    is the rollout's: with `env.few_shot > 0` it holds the demonstrations too."""
    from steprl_jax.agents.tasks import build_suite, toolworld_queries
    from steprl_jax.data.demonstrations import tool_call_demonstration
    from steprl_jax.data.toolworld import execute_plan

    if config.task.name != "toolworld":
        raise ValueError(f"expert_rows: expert plans exist for task.name=toolworld, not {config.task.name!r}")
    if max_result_chars is None:
        max_result_chars = int(config.rollout.get("max_result_chars", MAX_RESULT_CHARS))
    suite = build_suite(config, split)
    world, queries = toolworld_queries(config, split)
    by_id = {q.id: q for q in queries}
    rows = []
    for task in suite.tasks:
        query = by_id[task.id]
        results = [[clip_result(r, max_result_chars) for r in step] for step in execute_plan(world, query)]
        try:
            rows.append(demonstration_row(suite.env, tokenizer, task,
                                          tool_call_demonstration(query.question, query.plan, results)))
        finally:
            suite.env.release(task)  # the task's tool registry, opened for its schemas
    return rows
