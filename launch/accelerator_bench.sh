#!/usr/bin/env bash
# One prepared benchmark for a GPU or TPU host (under 8 minutes on one chip): decode tok/s at
# batch 1 / 32 / 256 with the share of the HBM-bandwidth roofline, and the train step's MFU for
# a 1B-class model (random weights in the Llama-3.2-1B shape, bf16). Figures go to stdout and to
# runs/accelerator_bench.json. Needs JAX with the accelerator (pip install -e ".[gpu]" or ".[tpu]").
#   bash launch/accelerator_bench.sh [EXTRA ARGS for python -m steprl_jax.benchmarks.accelerator]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p runs
timeout 480 "$PY" -m steprl_jax.benchmarks.accelerator --json runs/accelerator_bench.json "$@"
