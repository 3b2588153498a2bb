#!/usr/bin/env bash
# Run the test suite on another torch release than CI's (CI: scripts/test.sh, torch 2.13.0):
#
#   bash scripts/test-torch.sh 2.15.0                              # the whole suite
#   bash scripts/test-torch.sh 2.14.1 tests/runtime/test_runtime_schedules.py -x   # pytest arguments follow
#
# Creates (or reuses) .venv-torch-VERSION with that torch from the package index, pp-core
# (editable) with the suite's extras and the example plugin, then runs pytest in it. A pip
# configuration that caps torch (a `constraint` file, as on machines whose disk holds one torch
# wheel) is lifted for this venv's installs only (PIP_CONSTRAINT=/dev/null); nothing else of the
# configuration changes. The registry's wheels of recent releases are the CUDA builds (several GB
# with their nvidia-* dependencies); they run on CPU as well.
#
# Set PP_CORE_TORCH_VENV to use another folder, PYTHON to pick the interpreter that creates it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ ! "$1" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    echo "usage: bash scripts/test-torch.sh VERSION [pytest arguments...], e.g. 2.15.0" >&2
    exit 2
fi
version="$1"
shift
venv="${PP_CORE_TORCH_VENV:-.venv-torch-$version}"
stamp="$venv/.pp-core-setup"
want=$( { pwd; echo "$version"; cat scripts/test-torch.sh pyproject.toml \
          examples/pp_example_plugin/pyproject.toml; } | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    pip=(env PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet
         --disable-pip-version-check --progress-bar off)
    "${pip[@]}" --upgrade "pip>=23" "setuptools>=77"
    "${pip[@]}" "torch==$version"
    # pp-core's distribution was called pp-core before it took a name of its own on the package
    # index (pp-core-torch); a venv made then still holds it, and its entry points would
    # register every built-in plugin twice
    "$venv/bin/python" -m pip uninstall --yes --quiet pp-core >/dev/null 2>&1 || true
    # torch pinned again, so that resolving pp-core's extras can never move it
    "${pip[@]}" -e ".[suite]" "torch==$version"
    "${pip[@]}" --no-deps ./examples/pp_example_plugin
    echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'from', torch.__file__)"
exec "$venv/bin/python" -m pytest -q "$@"
