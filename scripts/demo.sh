#!/usr/bin/env bash
# The main command of README.md: set up .venv if needed, then train the demo GPT as a
# 4-stage pipeline (2 ranks x 2 stages) on the text shipped with pp-core.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec "${PP_CORE_VENV:-.venv}/bin/pp-core" run examples/demo.yaml "$@"
