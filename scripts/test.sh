#!/usr/bin/env bash
# The test command of README.md: set up .venv if needed, then run the whole suite (CI's command).
#   bash scripts/test.sh              # everything
#   bash scripts/test.sh --fast       # the fast half: no test that starts ranks or runs pp-core
#   bash scripts/test.sh tests/schedule -x    # pytest arguments follow (with or without --fast)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not ranks and not cli")
    export PP_CORE_FAST_TIER=1  # tests/conftest.py: an unmarked test that starts a process fails
fi
# the ten slowest tests are printed at the end of every run, so growth is seen when it happens
exec "${PP_CORE_VENV:-.venv}/bin/python" -m pytest -q --durations=10 "${tier[@]}" "$@"
