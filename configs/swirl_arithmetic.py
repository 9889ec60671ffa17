"""SWiRL on the embedded default: SmolLM2-135M-Instruct, built-in arithmetic word problems, a
calculator, rule judges and the rule reward model (no external service). The README's main job.

    python -m steprl_jax.main --config=configs/swirl_arithmetic.py
    python -m steprl_jax.main --config=configs/swirl_arithmetic.py --config.stages=collect,judge,filter

Training questions come from templates 0-6 of the built-in set; held-out questions (other
numbers, and two templates never trained on) from the test split. Sizes fit a 2-core CPU.
"""
from ml_collections import ConfigDict

from configs import demo
from configs.rl import MAX_MICROBATCH_TOKENS


def get_config(arg=None):
    c = demo.get_config()
    c.job = "swirl"
    c.workdir = "runs/swirl_arithmetic"
    c.stages = "collect,judge,filter,train,eval"  # add sft for the baseline
    c.task.splits = True  # disjoint built-in train / test splits
    c.task.num_tasks = 16  # training questions
    c.task.eval_path = ""
    c.task.eval_offset = 0
    c.task.eval_num_tasks = 32  # held-out questions
    c.env.few_shot = 1  # one worked example keeps states short
    c.rollout.max_steps = 5
    c.rollout.max_new_tokens = 64
    c.rollout.max_context = 1024
    c.rollout.temperature = 0.7  # collection and stage-2 sampling; the loss uses the same value
    c.judge.batch_size = 64
    c.swirl = ConfigDict(dict(
        samples_per_question=2,  # K (paper: 5)
        filter="process",  # none | process | outcome | process_outcome
        granularity="trajectory",  # trajectory (paper) | step (our reading)
        drop_easy=False,
        train=ConfigDict(dict(
            group_size=4,  # G fresh actions per saved state
            batch_size=8,  # states per update
            updates=6, ppo_epochs=1, minibatches=1, num_microbatches=1,
            max_microbatch_tokens=MAX_MICROBATCH_TOKENS,
            advantage="rloo",  # rloo | zscore
            scale_by_std=False, agg="token_mean", eps_low=0.2, eps_high=0.2,
            kl_coef=0.0,  # k3 KL to the frozen initial policy
            save_every=4)),
        sft=ConfigDict(dict(epochs=2, batch_size=8, num_microbatches=1, max_microbatch_tokens=MAX_MICROBATCH_TOKENS)),
    ))
    # R(a | s): rule (documented heuristic) | local | http; scale binary (GOOD/BAD -> 1/0) | graded.
    # Empty fields are unset; http needs base_url and model, local takes model (default: the policy).
    c.reward = ConfigDict(dict(kind="rule", scale="binary", base_url="", model="", api_key_env="OPENAI_API_KEY",
                               votes=1, retries=3, timeout_s=60.0))
    c.optimizer = ConfigDict(dict(learning_rate=2e-5, warmup_steps=0, end_lr_ratio=0.1, weight_decay=0.0,
                                  max_grad_norm=1.0))
    c.eval = ConfigDict(dict(temperature=0.0, episodes_per_task=1))
    return c
