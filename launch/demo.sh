#!/usr/bin/env bash
# The main job on the embedded default (README quick start): sets up .venv if needed, then
# SmolLM2-135M-Instruct solves built-in arithmetic word problems with a calculator, judged by
# rule judges; results land in runs/demo/. Extra arguments are config overrides, e.g.
#   bash launch/demo.sh --config.task.num_tasks=32 --config.workdir=runs/demo32
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec python -m steprl_jax.main --config=configs/demo.py "$@"
