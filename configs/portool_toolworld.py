"""PORTool rollout trees on the assistant tool world (think + tool_call format).

    python -m steprl_jax.main --config=configs/portool_toolworld.py --config.rollout.tree.n=8
"""
from configs import demo


def get_config(arg=None):
    c = demo.get_config()
    c.workdir = "runs/portool_toolworld"
    c.task.name = "toolworld"
    c.task.num_tasks = 8
    c.task.failure_rate = 0.05
    c.env.format = "tool_call"
    c.env.tools = ()
    c.rollout.max_steps = 6
    c.rollout.max_new_tokens = 160
    c.rollout.max_context = 4096
    c.rollout.tree.enabled = True
    return c
