#!/usr/bin/env bash
# steprl_jax on GPU hosts: one host with several GPUs, or several hosts joined by jax.distributed.
#
#   launch/gpu.sh [--dry-run] setup                        the venv with the gpu extra (jax[cuda12])
#   launch/gpu.sh [--dry-run] run [-- MAIN_JOB_ARGS...]    the main job on this host
#
# One host: every local GPU in the trainer's mesh (fsdp over all of them unless the job's
# arguments give --config.mesh.*). Several hosts: run the same command on each, with
#   COORDINATOR=HOST0:PORT NUM_PROCESSES=N PROCESS_ID=K   (K = 0 on HOST0, which must be reachable
# on PORT from the others); the workdir must be one folder all hosts see (NFS or similar), since
# every host writes its shards of each checkpoint. Output goes to stdout; redirect as you like.
#
# Example, PORTool on two 8-GPU hosts:
#   host0$ COORDINATOR=host0:12355 NUM_PROCESSES=2 PROCESS_ID=0 launch/gpu.sh run -- \
#            --config=configs/portool_toolworld.py --config.model.compute_dtype=bfloat16 --config.workdir=/nfs/runs/p
#   host1$ COORDINATOR=host0:12355 NUM_PROCESSES=2 PROCESS_ID=1 launch/gpu.sh run -- (the same arguments)
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
COMMAND=${1:-}
shift || true
[ "${1:-}" = "--" ] && shift

run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

case "$COMMAND" in
  setup)
    if [ "$DRY_RUN" = 1 ]; then echo "EXTRAS=[gpu] . launch/_env.sh"; else EXTRAS="[gpu]" . launch/_env.sh; fi
    ;;
  run)
    EXTRA=()
    if [ -n "${COORDINATOR:-}" ]; then
      : "${NUM_PROCESSES:?set NUM_PROCESSES with COORDINATOR}" "${PROCESS_ID:?set PROCESS_ID with COORDINATOR}"
      EXTRA+=(--config.distributed.mode=on "--config.distributed.coordinator_address=$COORDINATOR"
              "--config.distributed.num_processes=$NUM_PROCESSES" "--config.distributed.process_id=$PROCESS_ID")
    fi
    [[ " $* " == *" --config.mesh."* ]] || EXTRA+=(--config.mesh.fsdp=-1)
    PY=python
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    run env JAX_PLATFORMS=cuda "$PY" -m steprl_jax.main "${EXTRA[@]}" "$@"
    ;;
  *)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
