"""pp2 x tp2 through ``pp-core run`` against pp2 x tp1: the per-step losses of 20 steps.

Runs ``examples/pp_tp.yaml`` twice (``distributed.tp_size`` 2 with sequence parallelism, then
1), every step logged, and prints the largest relative loss difference per optimizer as JSON and
a table. By hand (it starts 6 processes; minutes on a 2-core machine)::

    python benchmarks/check_pp_tp_run.py [--optimizer AdamW|SGD ...] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(workdir: Path, tp: int, optimizer: str, steps: int) -> list[float]:
    metrics = workdir / f"{optimizer}_tp{tp}.jsonl"
    lr = 3.0e-3 if optimizer == "AdamW" else 0.3
    command = [sys.executable, "-m", "pp_core", "run", str(ROOT / "examples" / "pp_tp.yaml"),
               "--set", f"distributed.tp_size={tp}",
               "--set", f"distributed.sequence_parallel={'true' if tp > 1 else 'false'}",
               "--set", f"train.optimizer={{name: {optimizer}, lr: {lr}}}",
               "--set", f"train.steps={steps}", "--set", "train.log_every=1",
               "--set", "output.progress=off", "--set", "output.summary=false",
               "--set", f"output.metrics={metrics}"]
    subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
            if "loss" in json.loads(line)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", nargs="+", default=["SGD", "AdamW"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer in args.optimizer:
            tp2 = run(Path(tmp), 2, optimizer, args.steps)
            tp1 = run(Path(tmp), 1, optimizer, args.steps)
            rel = [abs(a - b) / abs(b) for a, b in zip(tp2, tp1)]
            results[optimizer] = {"steps": len(rel), "max_rel_diff": max(rel),
                                  "rel_diff_per_step": rel, "loss_tp2": tp2, "loss_tp1": tp1}
    print(json.dumps(results))
    print(f"{'optimizer':<10} {'steps':>5} {'max rel diff':>13} {'first -> last loss (tp2)':>26}")
    for name, r in results.items():
        print(f"{name:<10} {r['steps']:>5} {r['max_rel_diff']:>13.2e} "
              f"{r['loss_tp2'][0]:>12.4f} -> {r['loss_tp2'][-1]:.4f}")


if __name__ == "__main__":
    main()
