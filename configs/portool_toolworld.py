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
    # No demonstrations in the prompt: the policy is warm-started by SFT on expert rows instead
    # (algorithms.sft.expert_rows). few_shot=k shows k of them (~230 tokens each).
    c.env.few_shot = 0
    # SmolLM2's context. A 6-step episode: prompt (~1,450 tokens) + 6 actions of at most 640 tokens
    # (the longest expert action, a sort_list over flights, is 589) + 5 observations (the longest
    # expert one is ~350): the costliest train plan padded to 6 steps needs 6,533 of the 8,192
    # (tests/test_toolworld_prompt.py).
    c.rollout.max_steps = 6
    c.rollout.max_new_tokens = 640
    c.rollout.max_context = 8192
    c.rollout.tree.enabled = True
    return c
