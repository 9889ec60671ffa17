"""Entry point: python -m steprl_jax.main --config=configs/X.py [--config.a.b=value ...]

`config.job` picks the job:

    evaluate   agent episodes (trajectories or PORTool trees) with live tools, judged; writes
               trajectories.jsonl (token-exact, resumable), metrics.json, summary.png
    swirl      SWiRL end to end (algorithms/swirl.py): collect, judge, filter, offline step-wise RL,
               SFT baseline, held-out evaluation (config.stages picks stages)
    rl         online RL (algorithms/online.py), config.algorithm: portool | grpo | grpo_fm | dapo |
               arpo | arpo_fm; SFT warm start, held-out evaluation every rl.eval_every iterations
"""
from __future__ import annotations

import logging
import os
import sys
import time

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config (ml_collections).")


def _evaluate(config) -> dict:
    from steprl_jax.evaluation import runner

    return runner.evaluate(config)


def _swirl(config) -> dict:
    from steprl_jax.algorithms import swirl

    return swirl.run(config)


def _rl(config) -> dict:
    from steprl_jax.algorithms import online

    return online.run(config)


JOBS = {"evaluate": _evaluate, "swirl": _swirl, "rl": _rl}


def run(config) -> dict:
    """Run the configured job; returns its summary (also written to the workdir)."""
    job = config.get("job", "evaluate")
    if job not in JOBS:
        raise ValueError(f"config.job: unknown job {job!r}; valid jobs: {', '.join(sorted(JOBS))}")
    if "distributed" in config:  # first: jax.distributed must start before any device is touched
        from steprl_jax.training import distributed

        distributed.initialize(config.distributed)
    return JOBS[job](config)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO lines
    started = time.time()
    metrics = run(_CONFIG.value)
    print(f"done in {time.time() - started:.1f} s; workdir {os.path.abspath(_CONFIG.value.workdir)}")
    if _CONFIG.value.get("job", "evaluate") == "evaluate":
        print({k: metrics[k] for k in ("episodes", "accuracy", "mean_steps", "tool_error_rate",
                                       "process_good_rate", "tokens_per_s") if k in metrics})


if __name__ == "__main__":
    from steprl_jax import malloc

    malloc.reexec_with_huge_pages()  # ~10% off a CPU train step (see malloc.py)
    sys.path.insert(0, os.getcwd())  # so that configs/ can import each other
    app.run(main)
