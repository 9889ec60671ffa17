"""PORTool rollout trees on the assistant tool world (think + tool_call format).

    python -m steprl_jax.main --config=configs/portool_toolworld.py --config.rollout.tree.n=8
"""
from ml_collections import ConfigDict

from configs import demo, rl


def get_config(arg=None):
    c = demo.get_config()
    c.workdir = "runs/portool_toolworld"
    c.task.name = "toolworld"
    c.task.num_tasks = 8
    c.task.failure_rate = 0.05
    c.env.format = "tool_call"
    # The tools every episode offers (and its prompt lists): empty, all 23; a subset must keep
    # response_gen (the answer). A query whose plan needs a tool left out has no demonstration.
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
    # Online RL (algorithms/online.py): python -m steprl_jax.main --config=configs/portool_toolworld.py
    # --config.algorithm=NAME trains NAME; --config.job=evaluate runs the tree evaluation only.
    c.job = "rl"
    c.algorithm = "portool"  # portool | grpo | grpo_fm | dapo | arpo | arpo_fm
    c.rl = rl.rl_config()
    c.task.eval_path, c.task.eval_offset, c.task.eval_num_tasks = "", 0, c.rl.eval.num_tasks
    # The outcome judge: rule by default (the reference answer); http/local with `votes` (majority).
    c.judge.outcome.update(dict(timeout_s=60.0, retries=3, backoff_s=1.0, max_backoff_s=30.0))
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=0, end_lr_ratio=1.0, weight_decay=0.0,
                                  max_grad_norm=1.0))
    return c
