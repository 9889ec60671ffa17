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

# transformers (tokenizers only here) announces at import that PyTorch is absent: true, and not news.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from steprl_jax import cli, config_schema  # noqa: E402
from steprl_jax.errors import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config (ml_collections).")
_DEBUG = flags.DEFINE_bool("debug", False, "Print an error's full traceback (it is always in <workdir>/main.log).")
LOG_NAME = "main.log"


def _evaluate(config) -> dict:
    from steprl_jax.algorithms.workdir import check_manifest
    from steprl_jax.evaluation import runner

    # the workdir's episodes resume: refuse one made by another job or with other settings
    r, tree = config.rollout, config.rollout.tree
    os.makedirs(config.workdir, exist_ok=True)
    check_manifest(config.workdir, {
        "job": "evaluate", "model.source": config.model.source, "task.name": config.task.name,
        "task.path": config.task.path, "task.split": config.task.get("split", ""),
        "task.offset": int(config.task.offset), "task.seed": int(config.task.get("seed", 0)), "seed": int(config.seed),
        "env.format": config.env.format,
        "env.few_shot": int(config.env.get("few_shot", 0)), "judge.outcome.kind": config.judge.outcome.kind,
        "judge.process.kind": config.judge.process.kind, "rollout.temperature": float(r.temperature),
        "rollout.top_k": int(r.top_k), "rollout.top_p": float(r.top_p), "rollout.max_steps": int(r.max_steps),
        "rollout.max_new_tokens": int(r.max_new_tokens), "rollout.tree": bool(tree.enabled) and
        {"n": int(tree.n), "f": int(tree.f), "schedule": tree.schedule, "fork_depths": list(tree.fork_depths)}})
    return runner.evaluate(config)


def _swirl(config) -> dict:
    from steprl_jax.algorithms import swirl

    return swirl.run(config)


def _rl(config) -> dict:
    from steprl_jax.algorithms import online

    return online.run(config)


JOBS = {"evaluate": _evaluate, "swirl": _swirl, "rl": _rl}


def check(config) -> None:
    """Refuse a config that cannot run, before anything is loaded or written (ConfigError)."""
    config_schema.check(config)  # the job's name too (config_schema.JOBS is JOBS' keys)
    if os.path.exists(config.workdir) and not os.path.isdir(config.workdir):
        raise ConfigError(f"config.workdir: {config.workdir} is a file, not a folder")


def run(config) -> dict:
    """Run the configured job; returns its summary (also written to the workdir)."""
    check(config)
    return _run_checked(config)


def _run_checked(config) -> dict:
    job = config.get("job", "evaluate")
    if "distributed" in config:  # first: jax.distributed must start before any device is touched
        from steprl_jax.training import distributed

        distributed.initialize(config.distributed)
    return JOBS[job](config)


def parse_flags(argv):
    """absl's flag parsing, with a bad flag or config file as one line (exit 2), not a traceback."""
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.get("job")  # a config file that did not load raises here, not at first use
        return rest
    except flags.Error as err:
        message = str(err)
    except Exception as err:  # config_flags: an unknown field, a config file that does not load
        cause = err.__cause__ or err.__context__ or err
        if isinstance(cause, (KeyError, AttributeError)):  # an override names a field the config lacks
            message = f"no such config field: {cause.args[0] if cause.args else cause}"
        elif isinstance(cause, OSError):  # the config file itself
            message = f"--config: {cause}"
        else:
            message = f"{type(cause).__name__}: {cause}"
    print("error: " + " ".join(message.split()), file=sys.stderr)
    sys.exit(cli.EXIT_BAD_INPUT)


def _log_to_workdir(workdir: str) -> str:
    """Every log record of the run also goes to <workdir>/main.log (and an error's traceback)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOG_NAME)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} command: {' '.join(sys.orig_argv)}\n")
    logging.getLogger().addHandler(handler)
    return path


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save INFO lines
    cli.install_interrupt_handlers()
    config, log_path = _CONFIG.value, None
    started = time.time()
    try:
        check(config)  # before the workdir exists: a refused config leaves nothing behind
        log_path = _log_to_workdir(config.workdir)
        metrics = _run_checked(config)
        if cli.interrupted():  # the interrupt was dropped on its way (see cli.interrupted)
            raise KeyboardInterrupt
    except BaseException as err:  # noqa: BLE001  every way out gets its one line and exit status
        sys.exit(cli.outcome(err, log_path, _DEBUG.value))
    print(f"done in {time.time() - started:.1f} s; workdir {os.path.abspath(config.workdir)}")
    if config.get("job", "evaluate") == "evaluate":
        print({k: metrics[k] for k in ("episodes", "accuracy", "mean_steps", "tool_error_rate",
                                       "process_good_rate", "tokens_per_s") if k in metrics})


def _import_paths() -> None:
    """configs/ imports its siblings as `configs.X`: the working directory and this checkout's
    root both serve (a run started from elsewhere with --config=/path/to/configs/X.py works)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (root, os.getcwd()):
        if os.path.isdir(os.path.join(path, "configs")) and path not in sys.path:
            sys.path.insert(0, path)


if __name__ == "__main__":
    from steprl_jax import malloc

    malloc.reexec_with_huge_pages()  # ~10% off a CPU train step (see malloc.py)
    _import_paths()
    app.run(main, flags_parser=parse_flags)
