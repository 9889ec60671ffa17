#!/usr/bin/env bash
# The full online-RL resume matrix of tests/test_rl_resume.py: every registered algorithm that trains on
# the tool world's format (all but torl and simpletir, whose code formats tests/test_torl.py and
# tests/test_simpletir.py run) trained end to end, killed with SIGKILL after its first checkpoint
# and resumed, compared bit for bit with an uninterrupted run (CI kills one case per loop, synchronous and asynchronous, and runs the rest uninterrupted). Extra
# arguments go to pytest (e.g. -k gigpo).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="[test]" . launch/_env.sh
export JAX_PLATFORMS=cpu STEPRL_JAX_RESUME_MATRIX=1
exec python -m pytest -q -p no:cacheprovider --durations=0 tests/test_rl_resume.py "$@"
