#!/usr/bin/env bash
# The full kill-anywhere matrix of tests/test_kill_anywhere.py: besides the chains CI runs, every
# kill point alone on a fresh workdir (SWiRL collect/judge/filter/stage 2/SFT, online GRPO), each
# compared with one uninterrupted run per job. Extra arguments go to pytest (e.g. -k grpo).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="[test]" . launch/_env.sh
export JAX_PLATFORMS=cpu STEPRL_JAX_KILL_MATRIX=1
exec python -m pytest -q -p no:cacheprovider --durations=0 tests/test_kill_anywhere.py "$@"
