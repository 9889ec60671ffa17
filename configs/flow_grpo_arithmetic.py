"""Flow-GRPO on the built-in arithmetic: SmolLM2-135M-Instruct plans (the trained policy), the same
model frozen executes (writes python for the sandbox), verifies and writes the final answer, and
math-verify checks it (+1 / -1); every planner call of a rollout is a training row with the
rollout's advantage (algorithms/flow_grpo.py). Sizes fit a 2-core CPU.

    python -m steprl_jax.main --config=configs/flow_grpo_arithmetic.py
    python -m steprl_jax.main --config=configs/flow_grpo_arithmetic.py --config.rl.flow_grpo.frozen.kind=http \\
        --config.rl.flow_grpo.frozen.base_url=http://127.0.0.1:8000/v1 --config.rl.flow_grpo.frozen.model=NAME

AgentFlow's own run (train/config.yaml): Qwen2.5-7B-Instruct planner, gpt-4o-mini frozen modules,
32 queries x 8 rollouts, 3 planner turns, planner temperature 0.7 and top_p 0.99, 2,048 reply
tokens, lr 1e-6, clip 0.2 / 0.3, KL loss 0.001. Held-out evaluation runs the same system, one
greedy rollout a query.
"""
from ml_collections import ConfigDict

from configs import demo, rl


def get_config(arg=None):
    c = demo.get_config()
    c.job = "rl"
    c.algorithm = "flow_grpo"
    c.workdir = "runs/flow_grpo_arithmetic"
    c.task.splits = True  # disjoint built-in train / test splits
    c.task.num_tasks = 64
    c.env.format = "flow"
    c.env.tools = ("python",)
    c.env.few_shot = 0
    c.env.python = ConfigDict(dict(wall_timeout_s=5.0, cpu_s=5, memory_bytes=1 << 30, stdout_chars=2000,
                                   max_concurrent=4, queue_timeout_s=30.0))
    c.rollout.max_steps = 3  # unused by the flow schedule: rl.flow_grpo.max_turns bounds the planner calls
    c.rollout.max_new_tokens = 192  # per planner reply
    c.rollout.max_context = 2048
    c.rollout.temperature = 0.7
    c.rollout.top_p = 0.99
    c.rollout.tree.n = 4  # rollouts per query (AgentFlow: 8)
    c.rl = rl.rl_config()
    c.rl.queries_per_iteration = 4
    c.rl.eval.num_tasks = 16
    c.rl.eval.votes = 1  # the rule judge is deterministic
    c.rl.flow_grpo.frozen.max_tokens = 192
    c.task.eval_path, c.task.eval_offset, c.task.eval_num_tasks = "", 0, c.rl.eval.num_tasks
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=0, end_lr_ratio=1.0, weight_decay=0.0,
                                  max_grad_norm=1.0))
    return c
