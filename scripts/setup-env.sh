#!/usr/bin/env bash
# Create (or reuse) .venv with torch, pp-core and everything the tests and the demo need.
# torch is pinned to 2.13.0 here so pip takes the local CPU build; pyproject.toml states the
# supported range. Set PP_CORE_VENV to use another folder, PYTHON to pick the interpreter that
# creates it (default: python3 on PATH).
#
# A finished setup leaves a stamp in the venv: the hash of what it installed from (this script,
# both pyproject.toml files, the example plugin's code, this checkout's path). While the stamp
# matches and torch 2.13.0 is there, nothing is reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PP_CORE_VENV:-.venv}"
torch_version=2.13.0
stamp="$venv/.pp-core-setup"
want=$( { pwd; cat scripts/setup-env.sh pyproject.toml examples/pp_example_plugin/pyproject.toml \
          $(find examples/pp_example_plugin/pp_example_plugin -name '*.py' | LC_ALL=C sort); } \
        | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && "$venv/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('torch').split('+')[0] != '$torch_version')" 2>/dev/null; then
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    python="${PYTHON:-$(command -v python3 || command -v python3.11 || true)}"
    if [ -z "$python" ]; then
        echo "setup-env.sh: no python3 on PATH; set PYTHON=/path/to/python3 (3.10 or newer)" >&2
        exit 1
    fi
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade "pip>=23" "setuptools>=77"
"${pip[@]}" "torch==$torch_version"
# pp-core's distribution was called pp-core before it took a name of its own on the package
# index (pp-core-torch); a venv made then still holds it, and its entry points would
# register every built-in plugin twice
"$venv/bin/python" -m pip uninstall --yes --quiet pp-core >/dev/null 2>&1 || true
"${pip[@]}" -e ".[suite]"
# The example third-party plugin package, installed as a user would (examples/plugin_model.yaml
# names its model and dataset).
"${pip[@]}" ./examples/pp_example_plugin   # its dependency, pp-core-torch, is the checkout above
echo "$want" > "$stamp"
