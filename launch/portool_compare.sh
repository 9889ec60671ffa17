#!/usr/bin/env bash
# PORTool against its baselines at CPU scale (SmolLM2-135M-Instruct on the tool world): one SFT
# warm start on expert demonstrations, then the same budget of rollouts for each method from it,
# then the paper's table (python -m steprl_jax.evaluation.compare). Every run resumes where it
# stopped; a finished one is skipped. Usage:
#   bash launch/portool_compare.sh [ROOT] [METHOD ...]      (default runs/compare; all methods)
# Extra settings through the environment: OVERRIDES="--config.rl.iterations=4 ..."
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Compiled programs persist across runs and resumes (a tool-world train step took 20 min to compile
# on 2 cores beside another job): set JAX_COMPILATION_CACHE_DIR to move it, or to "" for none.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-$HOME/.cache/steprl_jax/jax}
ROOT=${1:-runs/compare}
shift || true
METHODS=("$@")
[ ${#METHODS[@]} -gt 0 ] || METHODS=(portool grpo dapo arpo grpo_fm arpo_fm)
# CPU sizes: n = 8 trajectories per query as in the paper (at n = 4 and temperature 0.7, 18 of 24
# GRPO-style groups had one reward for all their trajectories: no signal; at n = 8 and temperature
# 1.0, 2 of 12), 2 queries per iteration, 6 iterations (96 trajectories a method; ARPO starts 4 of
# them from the prompt, the default, and branches the others after tool calls), up to 6 steps of
# at most 160 new tokens, held-out evaluation of 96 queries before and after (at 32 an accuracy
# interval spans +-0.15; 96 resolved PORTool's, DAPO's and GRPO's gains over the warm start); packed rows of at
# most 4096 tokens (attention scores grow with the square of a row: a run with 8192-token rows was
# killed for memory beside another job on a 24 GiB host). On a 2-core CPU in bf16 a method's 6
# iterations took 8-20 min and an evaluation of 96 queries about 13-18 min.
CPU=(--config.task.num_tasks=256 --config.rollout.tree.n=8 --config.rollout.max_new_tokens=160
     --config.rollout.temperature=1.0 --config.rl.iterations=6 --config.rl.queries_per_iteration=2
     --config.rl.eval_every=6 --config.rl.eval.num_tasks=96 --config.optimizer.learning_rate=5e-6
     --config.rl.max_row_tokens=4096)
WARM=$ROOT/warm_start
if [ ! -f "$WARM/eval/iter_00000.metrics.json" ]; then
  # zero RL iterations: the SFT warm start (reused when policy/sft exists) and its held-out
  # evaluation (iteration 0), the SFT-only row of the table. 40 updates of 8 demonstrations drawn
  # from the 256 training tasks: held-out accuracy 0.375 [0.219, 0.562], where 16 updates over 64
  # tasks gave 0.125 [0.031, 0.250]. On a host with bf16 matrix instructions add
  # OVERRIDES="--config.model.compute_dtype=bfloat16" (28-37 s an update there).
  python -m steprl_jax.main --config=configs/portool_toolworld.py --config.workdir="$WARM" "${CPU[@]}" \
    --config.rl.warm_start.updates=40 --config.rl.warm_start.learning_rate=5e-5 ${OVERRIDES:-} \
    --config.rl.iterations=0  # last: an OVERRIDES' rl.iterations is for the methods, not this run
fi
for method in "${METHODS[@]}"; do
  # every method starts from the same policy: its iteration-0 evaluation is the warm start's
  mkdir -p "$ROOT/$method/eval"
  for f in "$WARM"/eval/iter_00000.*; do [ -e "$ROOT/$method/eval/${f##*/}" ] || cp "$f" "$ROOT/$method/eval/"; done
  python -m steprl_jax.main --config=configs/portool_toolworld.py --config.algorithm="$method" \
    --config.workdir="$ROOT/$method" --config.rl.warm_start.source="$WARM/policy/sft" "${CPU[@]}" ${OVERRIDES:-}
done
python -m steprl_jax.evaluation.compare "${METHODS[@]/#/$ROOT/}" --out "$ROOT/comparison"
