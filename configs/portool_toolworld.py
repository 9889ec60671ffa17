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
    # compact: one line a tool in the system prompt (~1,300 tokens for the 22 tools, ~3,250 as JSON
    # schemas); json: the schemas as the chat template takes them (templates that render tools).
    c.env.tool_rendering = "compact"
    c.rollout.max_steps = 6
    c.rollout.max_new_tokens = 160
    c.rollout.max_context = 4096
    c.rollout.tree.enabled = True
    return c
