"""SWiRL on GSM8K with a calculator (step cap 10, METHODS 1.1).

    python -m steprl_jax.main --config=configs/swirl_gsm8k.py
    python -m steprl_jax.main --config=configs/swirl_gsm8k.py --config.task.num_tasks=512 \\
        --config.swirl.samples_per_question=5

Training questions from `task.path` (GSM8K train), held-out ones from `task.eval_path` (test).
"""
from configs import swirl_arithmetic


def get_config(arg=None):
    c = swirl_arithmetic.get_config()
    c.workdir = "runs/swirl_gsm8k"
    c.task.name = "gsm8k"
    c.task.splits = False
    c.task.path = "../shared/data/gsm8k/train.jsonl"
    c.task.eval_path = "../shared/data/gsm8k/test_1000.jsonl"
    c.task.num_tasks = 64
    c.task.eval_num_tasks = 64
    c.rollout.max_steps = 10
    c.rollout.max_new_tokens = 96
    c.rollout.max_context = 2048
    c.env.few_shot = 2
    return c
