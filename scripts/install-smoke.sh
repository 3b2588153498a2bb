#!/usr/bin/env bash
# README's Install section, followed literally in a fresh venv (no extras), then one short
# `pp-core run` of the demo with a checkpoint, run from outside the checkout with nothing but the
# venv and /usr/bin:/bin on PATH. It catches what the test venv hides: a dependency only the
# extras bring in (numpy was one: dist.gather_object and DCP need it), a file missing from the
# installed package, a `pp-core` picked up from elsewhere. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)
python="${PYTHON:-$(command -v python3 || command -v python3.11 || true)}"
if [ -z "$python" ]; then
    echo "install-smoke.sh: no python3 on PATH; set PYTHON=/path/to/python3" >&2
    exit 1
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/pp-core-install-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$SECONDS
"$python" -m venv "$work/venv"
# --no-compile: no .pyc for all of torch up front (the slowest part); imports compile their own
pip=("$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" "torch==2.13.0"   # README: pip install torch==2.13.0
"${pip[@]}" "$checkout"       # README: pip install -e . (here the built package, not the tree)
cd "$work"                    # no import may come from the checkout
set +e
env -i PATH="$work/venv/bin:/usr/bin:/bin" HOME="${HOME:-$work}" \
    pp-core run "$checkout/examples/demo.yaml" --set train.steps=2 --set output.progress=plain \
    --set checkpoint.dir="$work/checkpoints" --set output.metrics="$work/metrics.jsonl" \
    --set output.trace="$work/trace.json" --set output.schedule_image="$work/schedule.svg" \
    > "$work/run.log" 2>&1
status=$?
set -e
cat "$work/run.log"
fail() { echo "install-smoke.sh: FAILED: $*" >&2; exit 1; }
[ "$status" = 0 ] || fail "pp-core run exited with $status"
grep -q "pp-core run summary" "$work/run.log" || fail "no run summary"
[ -f "$work/checkpoints/step_00000002/.metadata" ] || fail "no checkpoint at step 2"
[ "$(wc -l < "$work/metrics.jsonl")" -ge 2 ] || fail "metrics.jsonl lacks the 2 steps"
if grep -qi "numpy" "$work/run.log"; then fail "numpy is missing or broken in a plain install"; fi
echo "install-smoke.sh: README's install ran the demo for 2 steps and saved a checkpoint" \
     "($((SECONDS - started)) s)"
