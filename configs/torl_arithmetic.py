"""ToRL on the built-in arithmetic: SmolLM2-135M-Instruct writes reasoning and ```python blocks,
the Python sandbox runs the last one at ```output, the answer in \\boxed{} is checked by math-verify
(+1 / -1), and GRPO trains on the response (algorithms/torl.py). Sizes fit a 2-core CPU.

    python -m steprl_jax.main --config=configs/torl_arithmetic.py
    python -m steprl_jax.main --config=configs/torl_arithmetic.py --config.task.name=gsm8k \\
        --config.task.path=../shared/data/gsm8k/train.jsonl --config.task.eval_path=../shared/data/gsm8k/test_1000.jsonl

ToRL's own run (scripts/torl_1.5b.sh): Qwen2.5-Math-1.5B, 128 queries x 16 responses, 3,072
response tokens, C = 1 code run per response, temperature 1, lr 1e-6 constant, grad clip 1.
"""
from ml_collections import ConfigDict

from configs import demo, rl


def get_config(arg=None):
    c = demo.get_config()
    c.job = "rl"
    c.algorithm = "torl"
    c.workdir = "runs/torl_arithmetic"
    c.task.splits = True  # disjoint built-in train / test splits
    c.task.num_tasks = 64
    c.env.format = "code"
    c.env.tools = ("python",)
    c.env.few_shot = 1  # one worked example in the code format: a 135M chat model needs to see it
    # C: code runs per response; after them ```output is not run and the text goes on (ToRL).
    c.env.max_tool_calls = 1
    # The sandbox (tools/python_sandbox.py): wall clock and CPU seconds per run, memory, the output
    # kept (the policy sees at most 128 + 128 characters of it), sandboxes running at once.
    c.env.python = ConfigDict(dict(wall_timeout_s=5.0, cpu_s=5, memory_bytes=1 << 30, stdout_chars=2000,
                                   max_concurrent=4, queue_timeout_s=30.0))
    # A response is a few actions: each ```output ends one (C runs, then more text); the cap only
    # bounds a response that keeps asking for output past its runs.
    c.rollout.max_steps = 4
    c.rollout.max_new_tokens = 256
    c.rollout.max_context = 1536
    c.rollout.temperature = 1.0
    c.rollout.tree.n = 4  # responses per query (ToRL: 16)
    c.rl = rl.rl_config()
    c.rl.queries_per_iteration = 4
    c.rl.eval.num_tasks = 16
    c.rl.eval.votes = 1  # the rule judge is deterministic
    c.task.eval_path, c.task.eval_offset, c.task.eval_num_tasks = "", 0, c.rl.eval.num_tasks
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=0, end_lr_ratio=1.0, weight_decay=0.0,
                                  max_grad_norm=1.0))
    return c
