"""SWiRL data collection on HotPotQA with BM25 search over the questions' context paragraphs.

    python -m steprl_jax.main --config=configs/swirl_hotpotqa.py \
        --config.task.path=../shared/data/hotpotqa/dev_400.jsonl
"""
from configs import demo


def get_config(arg=None):
    c = demo.get_config()
    c.workdir = "runs/swirl_hotpotqa"
    c.task.name = "hotpotqa"
    c.task.path = "../shared/data/hotpotqa/dev_400.jsonl"
    c.task.num_tasks = 32
    c.env.tools = ("search",)
    c.rollout.max_steps = 5
    c.rollout.max_context = 2048
    c.rollout.episodes_per_task = 1
    return c
