"""Rollout schedules by name: how a query's trajectories are started, continued and forked.

    group      n independent trajectories (GRPO, DAPO, GiGPO)
    tree       PORTool's tree, static or resample (METHODS 2.3)
    arpo       ARPO's entropy-driven branching after tool calls
    tree_search  Tree-GRPO's M trees grown by expanding random nodes into fresh chains
    flow       AgentFlow's planner / executor / verifier rollouts, a fresh planner prompt per turn

Each is a module with `SCHEDULE` (agents/schedules/base.py): run(engine, queries, settings, key, seed)
-> one TreeRecord per query. Adding one: its module and one line below.
"""
from steprl_jax.agents.schedules import arpo, flow, group, tree, tree_search
from steprl_jax.agents.schedules.base import Query, Schedule

SCHEDULES = {s.name: s for s in (group.SCHEDULE, tree.SCHEDULE, arpo.SCHEDULE, tree_search.SCHEDULE,
                                     flow.SCHEDULE)}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown rollout schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


__all__ = ["Query", "Schedule", "SCHEDULES", "get_schedule"]
