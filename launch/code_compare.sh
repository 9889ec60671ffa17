#!/usr/bin/env bash
# The code-interpreter methods at CPU scale (SmolLM2-135M-Instruct on the built-in arithmetic with the
# Python sandbox; held-out questions from the test split, two of its nine templates never trained
# on): the base model, an SFT warm start on gold-step demonstrations in each code format, ToRL and
# SimpleTIR from their format's warm start, Flow-GRPO from a warm start of its planner (first turns
# handing the gold steps to the python tool; the frozen modules stay the base model), then one table (python -m steprl_jax.evaluation.compare): each policy's
# held-out accuracy and its paired difference from the base model on the same questions, and each
# RL run's difference from its own start. Every run resumes where it stopped; a finished one is
# skipped. Usage:
#   bash launch/code_compare.sh [ROOT] [RUN ...]   (default runs/code_compare; all runs, in order:
#                                                   base sft_code torl sft_turns simpletir flow_grpo)
# Extra settings through the environment: OVERRIDES="--config.model.compute_dtype=bfloat16 ..."; NO_VENV=1
# runs the python on PATH as it is (no virtual environment set-up).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${NO_VENV:-}" ] || . launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# Compiled programs persist across runs and resumes (a tool-world train step took 20 min to compile
# on 2 cores beside another job): set JAX_COMPILATION_CACHE_DIR to move it, or to "" for none.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-$HOME/.cache/steprl_jax/jax}
ROOT=${1:-runs/code_compare}
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(base sft_code torl sft_turns simpletir flow_grpo)
# The same budget for every method: 8 iterations of 4 queries x 8 responses (256 a method), lr 5e-6,
# held-out evaluation of 64 questions before and after (greedy, one episode a question).
CPU=(--config.task.num_tasks=256 --config.rollout.tree.n=8 --config.rollout.temperature=1.0
     --config.rl.iterations=8 --config.rl.queries_per_iteration=4 --config.rl.eval_every=8
     --config.rl.eval.num_tasks=64 --config.optimizer.learning_rate=5e-6)
# The warm starts: 40 updates of 8 demonstrations (gold steps of the training questions, the
# format's prompt), lr 5e-5, as the tool world's.
SFT=(--config.rl.warm_start.updates=40 --config.rl.warm_start.learning_rate=5e-5)
config_of() {
  case $1 in
    base|sft_code|torl) echo configs/torl_arithmetic.py ;;
    sft_turns|simpletir) echo configs/simpletir_arithmetic.py ;;
    flow_grpo) echo configs/flow_grpo_arithmetic.py ;;
    *) echo "code_compare.sh: unknown run '$1' (base sft_code torl sft_turns simpletir flow_grpo)" >&2; exit 2 ;;
  esac
}
start_of() {  # the run whose policy an RL run starts from (its evaluation is the run's iteration 0)
  case $1 in torl) echo sft_code ;; simpletir) echo sft_turns ;; *) echo "" ;; esac
}
for run in "${RUNS[@]}"; do
  config=$(config_of "$run")
  w=$ROOT/$run
  case $run in
    base)  # zero iterations, no warm start: the base model's evaluation in ToRL's format
      [ -f "$w/eval/iter_00000.metrics.json" ] || python -m steprl_jax.main --config="$config" \
        --config.workdir="$w" "${CPU[@]}" ${OVERRIDES:-} --config.rl.iterations=0 ;;
    sft_code|sft_turns)  # zero iterations: the warm start and its evaluation
      [ -f "$w/eval/iter_00000.metrics.json" ] || python -m steprl_jax.main --config="$config" \
        --config.workdir="$w" "${CPU[@]}" "${SFT[@]}" ${OVERRIDES:-} --config.rl.iterations=0 ;;
    *)
      from=$(start_of "$run")
      extra=()
      if [ -n "$from" ]; then
        mkdir -p "$w/eval"
        for f in "$ROOT/$from"/eval/iter_00000.*; do [ -e "$w/eval/${f##*/}" ] || cp "$f" "$w/eval/"; done
        extra=(--config.rl.warm_start.source="$ROOT/$from/policy/sft")
      fi
      # a run with no start of its own warm-starts in its workdir (its iteration 0 evaluates that)
      [ -n "$from" ] || extra=("${SFT[@]}")
      python -m steprl_jax.main --config="$config" --config.algorithm="$run" --config.workdir="$w" \
        "${extra[@]}" "${CPU[@]}" ${OVERRIDES:-} ;;
  esac
done
done_runs=()
for run in base sft_code torl sft_turns simpletir flow_grpo; do
  [ -d "$ROOT/$run/eval" ] && done_runs+=("$ROOT/$run")
done
# the reference row: the first run's iteration 0 (the base model once it has run)
python -m steprl_jax.evaluation.compare "${done_runs[@]}" --start-label "${done_runs[0]##*/}" --out "$ROOT/comparison"
