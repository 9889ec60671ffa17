#!/usr/bin/env bash
# The papers' tables at CPU scale, one command each, several seeds (SmolLM2-135M-Instruct):
#
#   bash launch/reproduce.sh swirl   [--seeds 0 1 2] [--root runs/reproduce] [--results results/reproduce] [-- CONFIG_OVERRIDES ...]
#   bash launch/reproduce.sh portool [--seeds 0 1 2] [--methods M ...] [--root runs/reproduce] [--results results/reproduce] [-- CONFIG_OVERRIDES ...]
#
# Resumable after any interruption: every run resumes in its own workdir (under --root) and a
# finished one is skipped; what the tables read is kept under --results, a small tree meant to be
# committed, so that a table can grow over several machines; the tables are written there again
# from whatever has finished, every seed on record whatever --seeds says (a row reports the seeds
# it has); --tables-only writes them and runs
# nothing. The seed varies training only: the held-out questions are the same for every seed
# (`task.seed`), so rows pair by question and seed (python -m steprl_jax.evaluation.seeds: each
# seed's value, the seed mean, 95% intervals over questions and seeds, paired differences).
#
# swirl, on the built-in arithmetic (calculator, step cap 5) and GSM8K (calculator, step cap 10;
# held-out questions from task.eval_path): per seed, trajectories collected and judged once, then
# SWiRL and SFT on the same units under each filter (none, process, outcome, process + outcome at
# trajectory granularity; process at step granularity); accuracy, process correctness under the
# rule judge (the one SWiRL filters and rewards by) and under the reference-guided step judge
# (which sees the golden solution: a measure the policy never trains against), actions per
# episode. Then a curve over the number of trajectories collected (CURVE, default "16 64 256", on
# the tasks in CURVE_TASKS, default arithmetic) for the filter whose SWiRL accuracy is best, with
# SWiRL's updates scaled with the trajectories (6 at 64), and transfer: each task's SWiRL
# policies of the process filter (the paper's) evaluated on the other task.
#
# portool, on the tool world: one SFT warm start, then PORTool, GRPO, GRPO_fm, DAPO, ARPO, ARPO_fm,
# GiGPO and Tree-GRPO from it, PORTool also at gamma 0.9 and 1.0; 8 iterations each, 96 held-out
# queries; accuracy, tool-call steps, unanswerable rate, formatting reward, each method's paired
# difference from the warm start, from GRPO and from PORTool. --methods runs only the methods named (e.g.
# `--methods portool grpo` for the main comparison's seeds first); the tables still show every method.
# --filters (swirl) runs only the filters named at the table's 32 questions (e.g. `--filters process`,
# the paper's, for a seed's main row first); the tables still show every filter.
#
# Disk: a finished run keeps its records, evaluations and metrics; its checkpoints and policies
# are removed once its evaluations (transfer's too) are written.
# Environment: NO_VENV=1 uses the python on PATH as it is; JAX_COMPILATION_CACHE_DIR as in
# launch/portool_compare.sh; CURVE (swirl) the trajectory counts of the curve ("" for none),
# CURVE_TASKS the tasks it runs on.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: bash launch/reproduce.sh swirl|portool [--seeds S ...] [--methods M ...] [--filters F ...] [--root DIR] [--results DIR] [--tables-only] [-- OVERRIDES ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
TABLE=$1
shift
case $TABLE in swirl|portool) ;; *) echo "reproduce.sh: unknown table '$TABLE' (swirl, portool)" >&2; usage ;; esac
SEEDS=(0 1 2)
ROOT=runs/reproduce
RESULTS=${RESULTS-results/reproduce}
TABLES_ONLY=""
EXTRA=()
METHODS=()
RUN_FILTERS=()
PORTOOL_METHODS=(portool grpo grpo_fm dapo arpo arpo_fm gigpo tree_grpo portool_gamma0.9 portool_gamma1.0)
while [ $# -gt 0 ]; do
  case $1 in
    --seeds) shift; SEEDS=(); while [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; do SEEDS+=("$1"); shift; done
             [ ${#SEEDS[@]} -gt 0 ] || { echo "reproduce.sh: --seeds needs at least one integer" >&2; usage; } ;;
    --methods) shift; while [ $# -gt 0 ] && [[ $1 != -* ]]; do METHODS+=("$1"); shift; done
               [ ${#METHODS[@]} -gt 0 ] || { echo "reproduce.sh: --methods needs at least one name" >&2; usage; } ;;
    --filters) shift; while [ $# -gt 0 ] && [[ $1 != -* ]]; do RUN_FILTERS+=("$1"); shift; done
               [ ${#RUN_FILTERS[@]} -gt 0 ] || { echo "reproduce.sh: --filters needs at least one name" >&2; usage; } ;;
    --root) [ $# -ge 2 ] || usage; ROOT=$2; shift 2 ;;
    --results) [ $# -ge 2 ] || usage; RESULTS=$2; shift 2 ;;
    --tables-only) TABLES_ONLY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "reproduce.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
check_names() {  # check_names FLAG KIND TABLE "ALLOWED ..." NAME...: FLAG belongs to TABLE, each NAME is allowed
  local flag=$1 kind=$2 table=$3 allowed=$4 name
  shift 4
  for name; do
    [ "$TABLE" = "$table" ] || { echo "reproduce.sh: $flag applies to the $table table only" >&2; usage; }
    [[ " $allowed " == *" $name "* ]] || { echo "reproduce.sh: unknown $kind '$name' for $flag ($allowed)" >&2; usage; }
  done
}
check_names --methods method portool "${PORTOOL_METHODS[*]}" ${METHODS[@]+"${METHODS[@]}"}
[ ${#METHODS[@]} -gt 0 ] || METHODS=("${PORTOOL_METHODS[@]}")
SWIRL_FILTERS=(none process outcome process_outcome process_step)
check_names --filters filter swirl "${SWIRL_FILTERS[*]}" ${RUN_FILTERS[@]+"${RUN_FILTERS[@]}"}
[ ${#RUN_FILTERS[@]} -gt 0 ] || RUN_FILTERS=("${SWIRL_FILTERS[@]}")
[ -n "${NO_VENV:-}" ] || . launch/_env.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-$HOME/.cache/steprl_jax/jax}
main() {  # main --config=FILE OVERRIDES...: a run, the command line's overrides last
  local config=$1
  shift
  python -m steprl_jax.main "$config" --config.progress=False "$@" ${EXTRA[@]+"${EXTRA[@]}"}
}
table_seeds() {  # the seeds a table reads: those of this invocation and every seed already finished
  { printf '%s\n' "${SEEDS[@]}"
    find "${RESULTS:-$ROOT}/$TABLE" -type d -name 'seed[0-9]*' 2>/dev/null | sed 's|.*/seed||'
  } | sort -nu
}
table() {  # the seeds table; where results are kept it reads and writes there (its paths under ROOT moved)
  local args=() a
  for a in "$@"; do [ -z "$RESULTS" ] || a=${a//"$ROOT/"/$RESULTS/}; args+=("$a"); done
  # every seed on record, not only this invocation's: `--seeds 2` adds a seed to the tables
  python -m steprl_jax.evaluation.seeds --seeds $(table_seeds) "${args[@]}"
}
FAILED=()
failed() {  # failed WORKDIR: a run that stopped with an error; the others go on, the tables say n/a
  FAILED+=("$1: $(grep -h '^crashed\|Error' "$1/main.log" 2>/dev/null | tail -n 1)")
}
# A finished run's resume state goes: its checkpoints (two per training stage, 1.4 GB each for
# SmolLM2-135M with its optimizer state) and its exported policies. What stays: records,
# evaluations, metrics.
prune() { local w=$1; shift; rm -rf "$w/checkpoints" "${@/#/$w/}"; }
copy_missing() {  # copy_missing FROM TO FILE...: FROM/FILE to TO/FILE where FROM has it and TO lacks it
  local from=$1 to=$2 f
  shift 2
  for f in "$@"; do
    [ -e "$to/$f" ] || [ ! -e "$from/$f" ] || { mkdir -p "$(dirname "$to/$f")"; cp "$from/$f" "$to/$f"; }
  done
}
# What a finished run leaves that a table or a later run reads (evaluations, metrics, a seed's
# collected and judged trajectories) is also kept under RESULTS, at the run's path below ROOT,
# .jsonl files gzipped: a small tree to commit, so that the tables grow across machines. A run
# whose files are there is restored from them and skipped. A kept file is never replaced: the
# first result is the one reported. RESULTS="" keeps nothing.
keep() {  # keep WORKDIR FILE...
  [ -n "$RESULTS" ] || return 0
  local w=$1 f to
  shift
  for f in "$@"; do
    to=$RESULTS/${w#"$ROOT"/}/$f
    [[ $f != *.jsonl ]] || to=$to.gz
    [ -e "$w/$f" ] && [ ! -e "$to" ] || continue
    mkdir -p "$(dirname "$to")"
    if [[ $f == *.jsonl ]]; then gzip -nc "$w/$f" > "$to"; else cp "$w/$f" "$to"; fi
  done
}
restore() {  # restore WORKDIR FILE...: the kept FILEs the workdir lacks
  [ -n "$RESULTS" ] || return 0
  local w=$1 f from
  shift
  for f in "$@"; do
    from=$RESULTS/${w#"$ROOT"/}/$f
    [ ! -e "$w/$f" ] || continue
    if [ -e "$from.gz" ]; then mkdir -p "$(dirname "$w/$f")"; gunzip -c "$from.gz" > "$w/$f"
    elif [ -e "$from" ]; then mkdir -p "$(dirname "$w/$f")"; cp "$from" "$w/$f"; fi
  done
}

# ----------------------------------------------------------------------------- SWiRL
SWIRL_TASKS=(arithmetic gsm8k)
FILTERS=("${SWIRL_FILTERS[@]}")
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

evaluations() { local name; for name; do echo "eval/$name.json eval/$name.trajectories.jsonl"; done; }
COLLECTED=(run.json trajectories.jsonl judged.jsonl stages/collect.json stages/judge.json)
TRANSFER_FILTER=process  # the filter whose SWiRL policies are evaluated on the other task

swirl_base() {  # the base model's held-out evaluation, one for every seed (greedy)
  local task=$1 w=$ROOT/swirl/$1/base
  [ -z "$TABLES_ONLY" ] || return 0
  restore "$w" $(evaluations base)
  [ -f "$w/eval/base.json" ] || main --config="$(swirl_config "$task")" --config.workdir="$w" \
    $(swirl_sizes 32) --config.stages=eval
  keep "$w" $(evaluations base)
}

swirl_transfer() {  # swirl_transfer TASK SEED POLICY: a policy trained on TASK evaluated on the other tasks
  local from=$1 seed=$2 policy=$3 to w
  for to in "${SWIRL_TASKS[@]}"; do
    [ "$from" != "$to" ] || continue
    w=$ROOT/swirl/transfer/${from}_on_$to/seed$seed
    [ -f "$w/eval/swirl.json" ] || {
      main --config="$(swirl_config "$to")" --config.workdir="$w" $(swirl_sizes 32) --config.stages=eval \
        --config.model.source="$policy" || { failed "$w"; return 1; }
      # the transferred policy evaluates as the run's "base": its own name here
      cp "$w/eval/base.json" "$w/eval/swirl.json"
    }
    keep "$w" eval/swirl.json $(evaluations base)
  done
}

# The curve's points train as long as their data: the config's SWiRL updates (sized for the
# main table's 64 trajectories) times trajectories / 64, at least one. With fixed updates a
# larger collection would only change which states the same few updates sample.
curve_updates() {  # curve_updates TASK QUESTIONS
  python - "$(swirl_config "$1")" "$(( $2 * K ))" <<'EOF'
import importlib.util, math, sys
spec = importlib.util.spec_from_file_location("config", sys.argv[1])
config = importlib.util.module_from_spec(spec)
spec.loader.exec_module(config)
print(max(1, math.ceil(config.get_config().swirl.train.updates * int(sys.argv[2]) / 64)))
EOF
}

swirl_filters() {  # swirl_filters TASK SEED QUESTIONS STAGES FILTER...: collect and judge once, then each filter
  local task=$1 seed=$2 questions=$3 stages=$4 dir filter w sizes
  shift 4
  [ -z "$TABLES_ONLY" ] || return 0
  dir=$ROOT/swirl/$task/seed$seed
  sizes=$(swirl_sizes "$questions")
  if [ "$questions" != 32 ]; then
    dir=$ROOT/swirl/$task/curve/n$((questions * K))/seed$seed
    sizes="$sizes --config.swirl.train.updates=$(curve_updates "$task" "$questions")"
  fi
  local todo=()
  for filter in "$@"; do
    w=$dir/$filter
    restore "$w" $(evaluations swirl sft) metrics.jsonl
    [ -f "$w/eval/swirl.json" ] && { [[ $stages != *sft* ]] || [ -f "$w/eval/sft.json" ]; } || todo+=("$filter")
  done
  [ ${#todo[@]} -gt 0 ] || return 0
  restore "$dir/collected" "${COLLECTED[@]}"
  main --config="$(swirl_config "$task")" --config.workdir="$dir/collected" --config.seed="$seed" \
    $(swirl_sizes "$questions") --config.stages=collect,judge
  keep "$dir/collected" "${COLLECTED[@]}"
  for filter in "${todo[@]}"; do
    w=$dir/$filter
    # the seed's collected, judged trajectories (and their stage markers) and the base's evaluation
    copy_missing "$dir/collected" "$w" "${COLLECTED[@]}"
    copy_missing "$ROOT/swirl/$task/base" "$w" eval/base.json eval/base.metrics.json eval/base.trajectories.jsonl
    # (a filter that keeps no unit, e.g. outcome filtering where the base answers nothing, fails)
    main --config="$(swirl_config "$task")" --config.workdir="$w" --config.seed="$seed" \
      $sizes $(filter_flags "$filter") --config.stages="$stages" || failed "$w"
    [ -f "$w/eval/swirl.json" ] || continue
    # the main table's policies of TRANSFER_FILTER on the other task, before they go: a run is
    # kept only with its transfer, so an interruption in between runs both again
    if [ "$questions" = 32 ] && [ "$filter" = "$TRANSFER_FILTER" ]; then
      swirl_transfer "$task" "$seed" "$w/policy/swirl" || continue
    fi
    keep "$w" $(evaluations swirl sft) metrics.jsonl comparison.md
    prune "$w" policy
  done
}

swirl_table() {  # swirl_table TASK: the filters' table from what has finished
  local task=$1 rows=() filter
  rows+=(--row "base=$ROOT/swirl/$task/base/eval/base.json")
  for filter in "${FILTERS[@]}"; do
    rows+=(--row "SFT ($filter)=$ROOT/swirl/$task/seed{seed}/$filter/eval/sft.json"
           --row "SWiRL ($filter)=$ROOT/swirl/$task/seed{seed}/$filter/eval/swirl.json")
    # the paper's claims: SWiRL above SFT on the same units; process filtering above the others
    rows+=(--pair "SWiRL ($filter) vs SFT ($filter)")
    [ "$filter" = process ] || rows+=(--pair "SWiRL (process) vs SWiRL ($filter)")
  done
  table "${rows[@]}" --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/$task/table"
}

best_filter() {  # the filter whose SWiRL row has the best seed-mean accuracy in TASK's table
  python - "${RESULTS:-$ROOT}/swirl/$1/table.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
# a tie goes to process, the paper's filter
scored = [(r["accuracy"]["value"], name[7:-1] == "process", name[7:-1]) for name, r in rows.items()
          if name.startswith("SWiRL (") and r.get("accuracy")]
print(max(scored)[2] if scored else "process")
EOF
}

run_swirl() {
  local task seed n best rows
  for task in "${SWIRL_TASKS[@]}"; do
    swirl_base "$task"
    for seed in "${SEEDS[@]}"; do
      swirl_filters "$task" "$seed" 32 filter,train,sft,eval "${RUN_FILTERS[@]}"
    done
    swirl_table "$task"
  done
  # the curve: the best filter with fewer and more trajectories (GSM8K only on request: its base
  # answers no question, so its points cost hours and measure nothing)
  # (CURVE="" leaves the curve out, its table too: the kept points stay tabled as they were)
  for task in ${CURVE_TASKS-arithmetic}; do
    [ -n "${CURVE-16 64 256}" ] || break
    best=$(best_filter "$task")
    rows=(--row "base=$ROOT/swirl/$task/base/eval/base.json")
    for n in ${CURVE-16 64 256}; do
      if [ "$n" != $((32 * K)) ]; then
        for seed in "${SEEDS[@]}"; do swirl_filters "$task" "$seed" $((n / K)) filter,train,eval "$best"; done
        rows+=(--row "SWiRL ($best), $n trajectories=$ROOT/swirl/$task/curve/n$n/seed{seed}/$best/eval/swirl.json")
      else
        rows+=(--row "SWiRL ($best), $n trajectories=$ROOT/swirl/$task/seed{seed}/$best/eval/swirl.json")
      fi
    done
    table "${rows[@]}" --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/$task/curve"
  done
  local from to
  for from in "${SWIRL_TASKS[@]}"; do  # transfer: TRANSFER_FILTER's policies on the other task
    for to in "${SWIRL_TASKS[@]}"; do
      [ "$from" != "$to" ] || continue
      table --row "base=$ROOT/swirl/$to/base/eval/base.json" \
        --row "SWiRL trained on $to=$ROOT/swirl/$to/seed{seed}/$TRANSFER_FILTER/eval/swirl.json" \
        --row "SWiRL trained on $from=$ROOT/swirl/transfer/${from}_on_$to/seed{seed}/eval/swirl.json" \
        --reference base --metrics "${SWIRL_METRICS[@]}" --out "$ROOT/swirl/transfer/${from}_on_$to"
    done
  done
}

# ----------------------------------------------------------------------------- PORTool
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

PORTOOL_FINAL=(eval/iter_00008.metrics.json eval/iter_00008.trajectories.jsonl metrics.jsonl)
WARM_EVAL=(eval/iter_00000.metrics.json eval/iter_00000.trajectories.jsonl)

portool_warm_start() {  # the SFT warm start every method starts from, made here where it is missing
  local warm=$1 kept
  [ -d "$warm/policy/sft" ] && return 0
  # The policy (0.5 GB) is not kept, so another machine makes it again from the same
  # demonstrations and seed: the same up to the last bits of its arithmetic. The table's
  # warm-start row is the first evaluation kept; a remade policy is not evaluated again (its
  # 96 queries cost as much as half the SFT on a CPU): its training losses, step by step, are
  # recorded beside the kept run's instead.
  restore "$warm" "${WARM_EVAL[@]}"
  main --config=configs/portool_toolworld.py --config.workdir="$warm" "${PORTOOL_CPU[@]}" \
    --config.rl.warm_start.updates=40 --config.rl.warm_start.learning_rate=5e-5 --config.rl.iterations=0
  kept=$RESULTS/portool/warm_start/metrics.jsonl.gz
  if [ -n "$RESULTS" ] && [ -f "$kept" ]; then
    python - "$kept" "$warm/metrics.jsonl" >> "$RESULTS/portool/warm_start/remade.txt" <<'EOF'
import gzip, json, platform, sys
def losses(f):
    return {r["step"]: r["loss"] for r in map(json.loads, f) if r.get("stage") == "sft"}
kept, made = losses(gzip.open(sys.argv[1], "rt")), losses(open(sys.argv[2]))
gap = max(abs(kept[s] - made[s]) for s in kept) if kept.keys() == made.keys() else float("nan")
print(f"{platform.node()}: {len(made)} SFT updates (kept {len(kept)}), largest loss difference"
      f" from the kept run's {gap:.2e}")
EOF
  fi
  keep "$warm" "${WARM_EVAL[@]}" metrics.jsonl
}

run_portool() {
  local warm=$ROOT/portool/warm_start method seed w rows=()
  for seed in "${SEEDS[@]}"; do
    for method in "${METHODS[@]}"; do
      w=$ROOT/portool/$method/seed$seed
      [ -z "$TABLES_ONLY" ] || continue
      restore "$w" "${PORTOOL_FINAL[@]}"
      if [ ! -f "$w/eval/iter_00008.metrics.json" ]; then
        portool_warm_start "$warm"
        copy_missing "$warm" "$w" "${WARM_EVAL[@]}"
        main --config=configs/portool_toolworld.py $(method_flags "$method") --config.workdir="$w" \
          --config.seed="$seed" --config.rl.warm_start.source="$warm/policy/sft" "${PORTOOL_CPU[@]}" || failed "$w"
        [ -f "$w/eval/iter_00008.metrics.json" ] || continue
      fi
      # (also a run that finished but was stopped before this: keep never replaces a kept file)
      keep "$w" "${PORTOOL_FINAL[@]}" "${WARM_EVAL[@]}"
      prune "$w" policy
    done
  done
  rows=(--row "SFT (warm start)=$warm/eval/iter_00000.metrics.json")
  for method in "${PORTOOL_METHODS[@]}"; do
    rows+=(--row "$method=$ROOT/portool/$method/seed{seed}/eval/iter_00008.metrics.json")
  done
  # the paper's claims: gamma 0.95 (the default) above 0.9 and 1.0; the formatting reward's gain
  table "${rows[@]}" --reference "SFT (warm start)" --metrics "${PORTOOL_METRICS[@]}" --out "$ROOT/portool/table" \
    --pair "portool vs portool_gamma0.9" --pair "portool vs portool_gamma1.0" \
    --pair "grpo_fm vs grpo" --pair "arpo_fm vs arpo"
  table "${rows[@]:2}" --reference grpo --metrics "${PORTOOL_METRICS[@]}" --out "$ROOT/portool/vs_grpo"
  table "${rows[@]:2}" --reference portool --metrics "${PORTOOL_METRICS[@]}" --out "$ROOT/portool/vs_portool"
}

"run_$TABLE"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf '%s\n' "${FAILED[@]}" > "$ROOT/$TABLE/failed.txt"
  echo "reproduce.sh: ${#FAILED[@]} run(s) failed (listed in $ROOT/$TABLE/failed.txt; run again to retry):" >&2
  printf '  %s\n' "${FAILED[@]}" >&2
  exit 1
fi
rm -f "$ROOT/$TABLE/failed.txt"
