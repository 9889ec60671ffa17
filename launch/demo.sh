#!/usr/bin/env bash
# The main job on the embedded default (README quick start): sets up .venv if needed, then runs a
# short SWiRL training run: SmolLM2-135M-Instruct collects trajectories on built-in arithmetic word
# problems with a calculator, rule judges filter them, offline step-wise RL trains on the saved
# states with the rule reward model, and base and trained policies are evaluated on held-out
# problems (comparison table printed at the end; everything lands in runs/swirl_arithmetic/).
# Extra arguments are config overrides, e.g.
#   bash launch/demo.sh --config.swirl.train.updates=4 --config.workdir=runs/short
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec python -m steprl_jax.main --config=configs/swirl_arithmetic.py "$@"
