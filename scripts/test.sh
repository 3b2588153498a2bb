#!/usr/bin/env bash
# The test command of README.md: set up .venv if needed, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec "${PP_CORE_VENV:-.venv}/bin/python" -m pytest -q "$@"
