"""Entry point: python -m steprl_jax.main --config=configs/X.py [--config.a.b=value ...]

Runs agent episodes (sequential trajectories or PORTool trees) with live tools, judges
them, and writes into `config.workdir`:

    trajectories.jsonl   token-exact records (resumable: finished tasks are skipped)
    metrics.json         accuracy, mean steps, terminations, tool error rate, judge rates, tokens/s
    summary.png          a one-page plot of the same
"""
from __future__ import annotations

import logging
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config (ml_collections).")


def run(config) -> dict:
    """Run the configured job; returns the metrics dict (also written to the workdir)."""
    from steprl_jax.evaluation import runner

    return runner.evaluate(config)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.time()
    metrics = run(_CONFIG.value)
    print(f"done in {time.time() - started:.1f} s; workdir {os.path.abspath(_CONFIG.value.workdir)}")
    print({k: metrics[k] for k in ("episodes", "accuracy", "mean_steps", "tool_error_rate",
                                   "process_good_rate", "tokens_per_s") if k in metrics})


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # so that configs/ can import each other
    app.run(main)
