#!/usr/bin/env bash
# Create (or reuse) .venv with torch, pp-core and everything the tests and the demo need.
# torch is pinned to 2.13.0 here so pip takes the local CPU build; pyproject.toml states the
# supported range. Set PP_CORE_VENV to use another folder.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PP_CORE_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "pip>=23" "setuptools>=68" wheel
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test,transformers]"
# The example third-party plugin package, installed as a user would (examples/plugin_model.yaml
# names its model and dataset).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps ./examples/pp_example_plugin
