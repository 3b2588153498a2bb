"""The first hour's waits, as a user meets them: ``pp-core run`` to its first step, ``validate``
of every example, ``plan --world 4``; optionally a second tree beside this one, alternating.

    python benchmarks/bench_first_hour.py --rounds 3 --json benchmarks/results/bench_first_hour.json
    python benchmarks/bench_first_hour.py --other /tmp/before      # a checkout of an older commit

Every figure is a whole process started as a user starts it (``python -m pp_core``), with
``PYTHONPATH`` naming the tree measured; "first step" is the time from the command's start to
its progress line for step 1 (the run is then stopped). ``--other TREE`` runs the same commands
with that tree's code, alternating with this one's in every round, so both see the same load.
Prints JSON and a table with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
VALIDATED = ("demo", "1f1b", "zero_bubble", "pp_dp", "pp_tp", "moe", "tokenized")
FIRST_STEP = re.compile(rb"\bstep +1/")


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'plugins'}", "CUDA_VISIBLE_DEVICES": ""}


def first_step(tree: Path, limit: float = 300.0) -> float:
    """Seconds from ``pp-core run examples/demo.yaml`` starting to its line for step 1."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "pp_core", "run", str(tree / "examples/demo.yaml"),
                   "--set", "output.progress=plain", "--set", "train.log_every=1",
                   "--set", f"checkpoint.dir={out}/ckpt", "--set", f"output.metrics={out}/m.jsonl",
                   "--set", f"output.trace={out}/t.json",
                   "--set", f"output.schedule_image={out}/s.svg"]
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=out, env=_env(tree), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            for line in process.stdout:
                if FIRST_STEP.search(line):
                    return time.perf_counter() - started
                if time.perf_counter() - started > limit:
                    break
            raise RuntimeError(f"{tree}: no step 1 line within {limit} s")
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def timed(tree: Path, *args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pp_core", *args], cwd=tree, env=_env(tree),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: pp-core {' '.join(args)} -> {done.returncode}: "
                           f"{done.stderr[-500:]}")
    return time.perf_counter() - started


def measure(tree: Path, with_plan: bool) -> dict:
    figures = {"first_step_s": first_step(tree)}
    for name in VALIDATED:
        figures[f"validate {name}_s"] = timed(tree, "validate", f"examples/{name}.yaml")
    if with_plan:
        figures["plan --world 4_s"] = timed(tree, "plan", "examples/demo.yaml", "--world", "4")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--other", type=Path, help="a second tree, measured alternately")
    parser.add_argument("--plan-rounds", type=int, default=1,
                        help="rounds that also time plan --world 4 (minutes each)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = {"this": HERE, **({"other": args.other.resolve()} if args.other else {})}
    load_before = os.getloadavg()
    runs: dict = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(measure(tree, round_ < args.plan_rounds))
            print(f"round {round_ + 1} {name}: done", file=sys.stderr, flush=True)
    result = {"load_before": load_before, "load_after": os.getloadavg(),
              "trees": {name: str(tree) for name, tree in trees.items()}, "runs": runs,
              "median": {name: {key: statistics.median(r[key] for r in rs if key in r)
                                for key in rs[0]} for name, rs in runs.items()}}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    names = list(trees)
    print("\n| figure (median s) | " + " | ".join(names) + (" | this / other |" if args.other
                                                          else " |"))
    print("|---" * (len(names) + 1 + bool(args.other)) + "|")
    for key in result["median"]["this"]:
        values = [result["median"][n].get(key) for n in names]
        ratio = f" | {values[0] / values[1]:.2f}" if args.other and values[1] else ""
        print(f"| {key[:-2]} | " + " | ".join(f"{v:.2f}" for v in values) + ratio + " |")
    print(f"\nload average (1 min) {load_before[0]:.1f} -> {result['load_after'][0]:.1f}")


if __name__ == "__main__":
    main()
