"""SimpleTIR on the built-in arithmetic: SmolLM2-135M-Instruct reasons in turns that end at the
first complete ```python block, the Python sandbox runs it (final_answer(x) prints \\boxed{x}), the
output continues the turn; the answer in \\boxed{} is checked by math-verify (1 / 0), and GRPO trains
on the response with void-turn trajectories masked and uninformative groups re-sampled
(algorithms/simpletir.py). Sizes fit a 2-core CPU.

    python -m steprl_jax.main --config=configs/simpletir_arithmetic.py
    python -m steprl_jax.main --config=configs/simpletir_arithmetic.py --config.task.name=gsm8k \\
        --config.task.path=../shared/data/gsm8k/train.jsonl --config.task.eval_path=../shared/data/gsm8k/test_1000.jsonl

SimpleTIR's own run (README, train.sh): Qwen2.5-7B, 512 queries x 16 responses, at most 5 turns,
8,000 tokens per turn and 16,000 in all, temperature 1, lr 1e-6, grad clip 1, 2-3x oversampling.
"""
from ml_collections import ConfigDict

from configs import demo, rl


def get_config(arg=None):
    c = demo.get_config()
    c.job = "rl"
    c.algorithm = "simpletir"
    c.workdir = "runs/simpletir_arithmetic"
    c.task.splits = True  # disjoint built-in train / test splits
    c.task.num_tasks = 64
    c.env.format = "code_turns"
    c.env.tools = ("python",)
    c.env.few_shot = 0  # SimpleTIR's prompt carries its own example
    # The sandbox (tools/python_sandbox.py): wall clock (SimpleTIR: 3 s) and CPU seconds per run,
    # memory, the output kept (the policy sees at most 256 + 256 characters of it), sandboxes at once.
    c.env.python = ConfigDict(dict(wall_timeout_s=3.0, cpu_s=3, memory_bytes=1 << 30, stdout_chars=2000,
                                   max_concurrent=4, queue_timeout_s=30.0))
    c.rollout.max_steps = 5  # turns (SimpleTIR trains with 5)
    c.rollout.max_new_tokens = 256  # per turn
    c.rollout.max_context = 1536
    c.rollout.temperature = 1.0
    c.rollout.tree.n = 4  # responses per query (SimpleTIR: 16)
    c.rl = rl.rl_config()
    c.rl.queries_per_iteration = 4
    c.rl.eval.num_tasks = 16
    c.rl.eval.votes = 1  # the rule judge is deterministic
    c.task.eval_path, c.task.eval_offset, c.task.eval_num_tasks = "", 0, c.rl.eval.num_tasks
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=0, end_lr_ratio=1.0, weight_decay=0.0,
                                  max_grad_norm=1.0))
    return c
