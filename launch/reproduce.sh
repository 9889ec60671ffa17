#!/usr/bin/env bash
# The papers' tables at CPU scale, one command each, several seeds (SmolLM2-135M-Instruct):
#
#   bash launch/reproduce.sh swirl   [--seeds 0 1 2] [--root runs/reproduce] [-- CONFIG_OVERRIDES ...]
#   bash launch/reproduce.sh portool [--seeds 0 1 2] [--root runs/reproduce] [-- CONFIG_OVERRIDES ...]
#
# Resumable after any interruption: every run resumes in its own workdir and a finished one is
# skipped; the tables are written again from whatever has finished (a row reports the seeds it
# has). The seed varies training only: the held-out questions are the same for every seed
# (`task.seed`), so rows pair by question and seed (python -m steprl_jax.evaluation.seeds: each
# seed's value, the seed mean, 95% intervals over questions and seeds, paired differences).
#
# swirl, on the built-in arithmetic (calculator, step cap 5) and GSM8K (calculator, step cap 10;
# held-out questions from task.eval_path): per seed, trajectories collected and judged once, then
# SWiRL and SFT on the same units under each filter (none, process, outcome, process + outcome at
# trajectory granularity; process at step granularity); accuracy, process correctness under the
# rule judge (the one SWiRL filters and rewards by) and under the reference-guided step judge
# (which sees the golden solution: a measure the policy never trains against), actions per
# episode. Then a curve over the number of trajectories collected (CURVE, default "64 256 1024")
# for the filter whose SWiRL accuracy is best, and transfer: each task's best SWiRL policy
# evaluated on the other task.
#
# portool, on the tool world: one SFT warm start, then PORTool, GRPO, GRPO_fm, DAPO, ARPO, ARPO_fm,
# GiGPO and Tree-GRPO from it, PORTool also at gamma 0.9 and 1.0; 8 iterations each, 96 held-out
# queries; accuracy, tool-call steps, unanswerable rate, formatting reward, each method's paired
# difference from the warm start and from GRPO.
#
# Disk: a finished run keeps its records, evaluations and metrics (SWiRL's main-table policies
# too, 0.5 GB each, for transfer); its checkpoints are removed once its evaluation is written.
# Environment: NO_VENV=1 uses the python on PATH as it is; JAX_COMPILATION_CACHE_DIR as in
# launch/portool_compare.sh; CURVE (swirl) the trajectory counts of the curve ("" for none).
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: bash launch/reproduce.sh swirl|portool [--seeds S ...] [--root DIR] [-- OVERRIDES ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
TABLE=$1
shift
case $TABLE in swirl|portool) ;; *) echo "reproduce.sh: unknown table '$TABLE' (swirl, portool)" >&2; usage ;; esac
SEEDS=(0 1 2)
ROOT=runs/reproduce
EXTRA=()
while [ $# -gt 0 ]; do
  case $1 in
    --seeds) shift; SEEDS=(); while [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; do SEEDS+=("$1"); shift; done
             [ ${#SEEDS[@]} -gt 0 ] || { echo "reproduce.sh: --seeds needs at least one integer" >&2; usage; } ;;
    --root) [ $# -ge 2 ] || usage; ROOT=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "reproduce.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "${NO_VENV:-}" ] || . launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-$HOME/.cache/steprl_jax/jax}
main() {  # main --config=FILE OVERRIDES...: a run, the command line's overrides last
  local config=$1
  shift
  python -m steprl_jax.main "$config" --config.progress=False "$@" ${EXTRA[@]+"${EXTRA[@]}"}
}
table() { python -m steprl_jax.evaluation.seeds --seeds "${SEEDS[@]}" "$@"; }
FAILED=()
failed() {  # failed WORKDIR: a run that stopped with an error; the others go on, the tables say n/a
  FAILED+=("$1: $(grep -h '^crashed\|Error' "$1/main.log" 2>/dev/null | tail -n 1)")
}
# A finished run's resume state goes: its checkpoints (two per training stage, 1.4 GB each for
# SmolLM2-135M with its optimizer state) and the exported policies no later step reads. What is
# kept: records, evaluations, metrics, and SWiRL's policies of the main table (for transfer).
prune() { local w=$1; shift; rm -rf "$w/checkpoints" "${@/#/$w/}"; }
copy_missing() {  # copy_missing FROM TO FILE...: FROM/FILE to TO/FILE where TO lacks it
  local from=$1 to=$2 f
  shift 2
  for f in "$@"; do
    [ -e "$to/$f" ] || { mkdir -p "$(dirname "$to/$f")"; cp "$from/$f" "$to/$f"; }
  done
}

# ----------------------------------------------------------------------------- SWiRL
SWIRL_TASKS=(arithmetic gsm8k)
FILTERS=(none process outcome process_outcome process_step)
SWIRL_METRICS=(accuracy process_correctness reference_process_correctness mean_actions)
K=2  # trajectories collected per training question (swirl.samples_per_question)
swirl_config() { echo "configs/swirl_$1.py"; }
filter_flags() {
  case $1 in
    process_step) echo "--config.swirl.filter=process --config.swirl.granularity=step" ;;
    *) echo "--config.swirl.filter=$1 --config.swirl.granularity=trajectory" ;;
  esac
}
# Sizes: 32 training questions (64 trajectories), 64 held-out questions, the configs' training.
swirl_sizes() { echo "--config.task.num_tasks=$1 --config.task.eval_num_tasks=64"; }

swirl_base() {  # the base model's held-out evaluation, one for every seed (greedy)
  local task=$1 w=$ROOT/swirl/$1/base
  [ -f "$w/eval/base.json" ] || main --config="$(swirl_config "$task")" --config.workdir="$w" \
    $(swirl_sizes 32) --config.stages=eval
}

swirl_filters() {  # swirl_filters TASK SEED QUESTIONS STAGES FILTER...: collect and judge once, then each filter
  local task=$1 seed=$2 questions=$3 stages=$4 dir filter w
  shift 4
  dir=$ROOT/swirl/$task/seed$seed
  [ "$questions" = 32 ] || dir=$ROOT/swirl/$task/curve/n$((questions * K))/seed$seed
  main --config="$(swirl_config "$task")" --config.workdir="$dir/collected" --config.seed="$seed" \
    $(swirl_sizes "$questions") --config.stages=collect,judge
  for filter in "$@"; do
    w=$dir/$filter
    [ -f "$w/eval/swirl.json" ] && { [[ $stages != *sft* ]] || [ -f "$w/eval/sft.json" ]; } && continue
    # the seed's collected, judged trajectories (and their stage markers) and the base's evaluation
    copy_missing "$dir/collected" "$w" run.json trajectories.jsonl judged.jsonl stages/collect.json stages/judge.json
    copy_missing "$ROOT/swirl/$task/base" "$w" eval/base.json eval/base.metrics.json eval/base.trajectories.jsonl
    # (a filter that keeps no unit, e.g. outcome filtering where the base answers nothing, fails)
    main --config="$(swirl_config "$task")" --config.workdir="$w" --config.seed="$seed" \
      $(swirl_sizes "$questions") $(filter_flags "$filter") --config.stages="$stages" || failed "$w"
    if [ -f "$w/eval/swirl.json" ]; then
      if [ "$questions" = 32 ]; then prune "$w" policy/sft; else prune "$w" policy; fi
    fi
  done
}

swirl_table() {  # swirl_table TASK: the filters' table from what has finished
  local task=$1 rows=() filter
  rows+=(--row "base=$ROOT/swirl/$task/base/eval/base.json")
  for filter in "${FILTERS[@]}"; do
    rows+=(--row "SFT ($filter)=$ROOT/swirl/$task/seed{seed}/$filter/eval/sft.json"
           --row "SWiRL ($filter)=$ROOT/swirl/$task/seed{seed}/$filter/eval/swirl.json")
  done
  table "${rows[@]}" --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/$task/table"
}

best_filter() {  # the filter whose SWiRL row has the best seed-mean accuracy in TASK's table
  python - "$ROOT/swirl/$1/table.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
scored = [(r["accuracy"]["value"], name[7:-1]) for name, r in rows.items()
          if name.startswith("SWiRL (") and r.get("accuracy")]
print(max(scored)[1] if scored else "process")
EOF
}

run_swirl() {
  local task seed n best rows
  for task in "${SWIRL_TASKS[@]}"; do
    swirl_base "$task"
    for seed in "${SEEDS[@]}"; do
      swirl_filters "$task" "$seed" 32 filter,train,sft,eval "${FILTERS[@]}"
    done
    swirl_table "$task"
  done
  for task in "${SWIRL_TASKS[@]}"; do  # the curve: the best filter with more (or fewer) trajectories
    best=$(best_filter "$task")
    rows=(--row "base=$ROOT/swirl/$task/base/eval/base.json")
    for n in ${CURVE-64 256 1024}; do
      if [ "$n" != $((32 * K)) ]; then
        for seed in "${SEEDS[@]}"; do swirl_filters "$task" "$seed" $((n / K)) filter,train,eval "$best"; done
        rows+=(--row "SWiRL ($best), $n trajectories=$ROOT/swirl/$task/curve/n$n/seed{seed}/$best/eval/swirl.json")
      else
        rows+=(--row "SWiRL ($best), $n trajectories=$ROOT/swirl/$task/seed{seed}/$best/eval/swirl.json")
      fi
    done
    table "${rows[@]}" --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/$task/curve"
  done
  local from to w
  for from in "${SWIRL_TASKS[@]}"; do  # transfer: each task's best SWiRL policy on the other task
    best=$(best_filter "$from")
    for to in "${SWIRL_TASKS[@]}"; do
      [ "$from" != "$to" ] || continue
      for seed in "${SEEDS[@]}"; do
        w=$ROOT/swirl/transfer/${from}_on_$to/seed$seed
        [ -f "$w/eval/swirl.json" ] || [ ! -d "$ROOT/swirl/$from/seed$seed/$best/policy/swirl" ] || {
          main --config="$(swirl_config "$to")" --config.workdir="$w" $(swirl_sizes 32) --config.stages=eval \
            --config.model.source="$ROOT/swirl/$from/seed$seed/$best/policy/swirl" || failed "$w"
          # the transferred policy evaluates as the run's "base": its own name here
          [ ! -f "$w/eval/base.json" ] || cp "$w/eval/base.json" "$w/eval/swirl.json"
        }
      done
      table --row "base=$ROOT/swirl/$to/base/eval/base.json" \
        --row "SWiRL trained on $to=$ROOT/swirl/$to/seed{seed}/$(best_filter "$to")/eval/swirl.json" \
        --row "SWiRL trained on $from=$ROOT/swirl/transfer/${from}_on_$to/seed{seed}/eval/swirl.json" \
        --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/transfer/${from}_on_$to"
    done
  done
}

# ----------------------------------------------------------------------------- PORTool
PORTOOL_METHODS=(portool grpo grpo_fm dapo arpo arpo_fm gigpo tree_grpo portool_gamma0.9 portool_gamma1.0)
PORTOOL_METRICS=(accuracy tool_steps unanswerable format_reward)
# As launch/portool_compare.sh, with 8 iterations: n = 8 trajectories a query, 2 queries an
# iteration (128 trajectories a method and seed), held-out evaluation of 96 queries.
PORTOOL_CPU=(--config.task.num_tasks=256 --config.rollout.tree.n=8 --config.rollout.max_new_tokens=160
             --config.rollout.temperature=1.0 --config.rl.iterations=8 --config.rl.queries_per_iteration=2
             --config.rl.eval_every=8 --config.rl.eval.num_tasks=96 --config.optimizer.learning_rate=5e-6
             --config.rl.max_row_tokens=4096)
method_flags() {
  case $1 in
    portool_gamma*) echo "--config.algorithm=portool --config.rl.gamma=${1#portool_gamma}" ;;
    *) echo "--config.algorithm=$1" ;;
  esac
}

run_portool() {
  local warm=$ROOT/portool/warm_start method seed w rows=()
  [ -f "$warm/eval/iter_00000.metrics.json" ] || main --config=configs/portool_toolworld.py \
    --config.workdir="$warm" "${PORTOOL_CPU[@]}" --config.rl.warm_start.updates=40 \
    --config.rl.warm_start.learning_rate=5e-5 --config.rl.iterations=0
  for seed in "${SEEDS[@]}"; do
    for method in "${PORTOOL_METHODS[@]}"; do
      w=$ROOT/portool/$method/seed$seed
      [ -f "$w/eval/iter_00008.metrics.json" ] && continue
      copy_missing "$warm" "$w" eval/iter_00000.metrics.json eval/iter_00000.trajectories.jsonl
      main --config=configs/portool_toolworld.py $(method_flags "$method") --config.workdir="$w" \
        --config.seed="$seed" --config.rl.warm_start.source="$warm/policy/sft" "${PORTOOL_CPU[@]}" || failed "$w"
      [ ! -f "$w/eval/iter_00008.metrics.json" ] || prune "$w" policy
    done
  done
  rows=(--row "SFT (warm start)=$warm/eval/iter_00000.metrics.json")
  for method in "${PORTOOL_METHODS[@]}"; do
    rows+=(--row "$method=$ROOT/portool/$method/seed{seed}/eval/iter_00008.metrics.json")
  done
  table "${rows[@]}" --reference "SFT (warm start)" --metrics "${PORTOOL_METRICS[@]}" --out "$ROOT/portool/table"
  table "${rows[@]:2}" --reference grpo --metrics "${PORTOOL_METRICS[@]}" --out "$ROOT/portool/vs_grpo"
}

"run_$TABLE"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf '%s\n' "${FAILED[@]}" > "$ROOT/$TABLE/failed.txt"
  echo "reproduce.sh: ${#FAILED[@]} run(s) failed (listed in $ROOT/$TABLE/failed.txt; run again to retry):" >&2
  printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
rm -f "$ROOT/$TABLE/failed.txt"
