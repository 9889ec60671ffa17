"""SWiRL on HotPotQA with BM25 search over the questions' context paragraphs (step cap 5).

    python -m steprl_jax.main --config=configs/swirl_hotpotqa.py
    python -m steprl_jax.main --config=configs/swirl_hotpotqa.py --config.job=evaluate --config.task.num_tasks=32

Training questions are rows [offset, offset + num_tasks) of `task.path`, held-out ones rows
[eval_offset, eval_offset + eval_num_tasks); the worked search examples shown in the prompt come
from rows outside both.
"""
from configs import swirl_arithmetic


def get_config(arg=None):
    c = swirl_arithmetic.get_config()
    c.workdir = "runs/swirl_hotpotqa"
    c.task.name = "hotpotqa"
    c.task.splits = False
    c.task.path = "../shared/data/hotpotqa/dev_400.jsonl"
    c.task.eval_path = ""
    c.task.num_tasks = 32
    c.task.offset = 0
    c.task.eval_offset = 200
    c.task.eval_num_tasks = 64
    c.env.tools = ("search",)
    c.env.few_shot = 2
    c.rollout.max_steps = 5
    c.rollout.max_new_tokens = 64
    c.rollout.max_context = 2048
    c.judge.partial_f1 = 0.0
    return c
