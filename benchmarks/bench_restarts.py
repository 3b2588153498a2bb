"""What a failure and a save cost: recovery time after a killed rank, and how long a save holds
the step, synchronous against ``checkpoint.async``, at two model sizes.

Run by hand (not part of the suite): ``python benchmarks/bench_restarts.py [--json FILE]``.

* **recovery**: ``pp-core run`` of the tiny GPT at pp 2 x dp 2, a checkpoint every 4 steps,
  ``max_restarts: 1``; rank 1 SIGKILLs itself as step 7 begins (:class:`Killer`). The run's own
  account (the ``"event": "restart"`` line of its metrics file) gives the time from the last step
  before the failure to the first after it, and its parts: down (detection, stopping and starting
  the ranks, rendezvous), start and load (build, checkpoint read), first step.
* **saves**: the GPT at two sizes on pp 2, a checkpoint every 2 of 8 steps, once with synchronous
  saves and once with ``checkpoint.async``; the summary's "a save held the step" (mean), and the
  mean step time of the steps during which a background write runs (the step after a save)
  against the others.

Prints JSON (with the load average), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
_CALLS = [0]
SIZES = {"small": {"dim": 256, "num_layers": 4}, "large": {"dim": 768, "num_layers": 8}}

try:  # the model plugin, only where the run imports this module as the model's home
    from pp_core_builtins.models import GPT

    class Killer(GPT):
        """Rank 1 sends itself SIGKILL as the first attempt's step 7 begins (4 forwards a step)."""

        def forward(self, x):
            _CALLS[0] += 1
            if os.environ.get("RANK") == "1" and _CALLS[0] == 6 * 4 + 1 and \
                    os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(x)
except ImportError:  # pragma: no cover
    Killer = None


def _spec(tmp: Path, name: str, model_args: dict, target: str | None, **extra) -> Path:
    spec = {
        "model": {"target": target, "args": model_args} if target else
        {"name": "gpt", "args": model_args},
        "data": {"name": "synthetic", "args": {"seq_len": model_args["max_seq_len"],
                                               "vocab_size": model_args["vocab_size"]}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "device": "cpu", **extra.pop("distributed", {})},
        "train": {"steps": 8, "log_every": 1},
        "checkpoint": {"dir": str(tmp / name), **extra.pop("checkpoint", {})},
        "output": {"progress": "plain", "metrics": str(tmp / f"{name}.jsonl")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(path: Path) -> tuple[str, list[dict]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{ROOT}"}
    env.pop("PP_CORE_TIMEOUT", None)
    result = subprocess.run([sys.executable, "-m", "pp_core", "run", str(path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{path.name} failed:\n{result.stderr[-3000:]}")
    metrics = Path(str(path).replace(".yaml", ".jsonl"))
    return result.stdout, [json.loads(line) for line in metrics.read_text().splitlines()]


def recovery(tmp: Path) -> dict:
    args = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
    path = _spec(tmp, "recovery", args, "bench_restarts:Killer",
                 distributed={"dp_size": 2, "max_restarts": 1, "timeout_s": 30},
                 checkpoint={"every": 4})
    _, lines = _run(path)
    found = next(line for line in lines if line.get("event") == "restart")
    return {key: found[key] for key in ("recovery_s", "down_s", "startup_s", "first_step_s",
                                        "steps_redone")}


def saves(tmp: Path, size: str) -> dict:
    args = {"vocab_size": 256, "num_heads": 4, "max_seq_len": 64, **SIZES[size]}
    out = {}
    for mode in ("sync", "async"):
        path = _spec(tmp, f"{size}-{mode}", args, None,
                     checkpoint={"every": 2, "async": mode == "async"})
        stdout, lines = _run(path)
        held = re.search(r"a save held the step ([\d,]+) ms", stdout)
        steps = {line["step"]: line["step_time_s"] for line in lines if "step_time_s" in line}
        during = [t for s, t in steps.items() if s % 2 == 1 and s > 1]  # the write runs
        others = [t for s, t in steps.items() if s % 2 == 0]
        ckpt = tmp / f"{size}-{mode}" / "step_00000008"
        out[mode] = {"held_ms": float(held.group(1).replace(",", "")) if held else None,
                     "step_s_during_write": sum(during) / len(during),
                     "step_s_otherwise": sum(others) / len(others),
                     "checkpoint_mib": sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the JSON here")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-restarts-") as folder:
        tmp = Path(folder)
        result = {"load_average_before": os.getloadavg(), "recovery": recovery(tmp),
                  "saves": {size: saves(tmp, size) for size in SIZES},
                  "load_average_after": os.getloadavg()}
    text = json.dumps(result, indent=1)
    print(text)
    if options.json:
        Path(options.json).write_text(text)
    r = result["recovery"]
    print(f"\nrecovery (tiny GPT, pp 2 x dp 2, SIGKILL after step 6, resumed at 4): "
          f"{r['recovery_s']:.2f} s = down {r['down_s']:.2f} + start and load "
          f"{r['startup_s']:.2f} + first step {r['first_step_s']:.2f} "
          f"(+ {r['steps_redone']} steps redone after it)")
    print(f"{'size':6} {'ckpt MiB':>9} {'sync held ms':>13} {'async held ms':>14} "
          f"{'async/sync':>11} {'step s (write running)':>23} {'step s (not)':>13}")
    for size, modes in result["saves"].items():
        sync, asyn = modes["sync"], modes["async"]
        share = asyn["held_ms"] / sync["held_ms"] if sync["held_ms"] else float("nan")
        print(f"{size:6} {sync['checkpoint_mib']:9.1f} {sync['held_ms']:13.0f} "
              f"{asyn['held_ms']:14.0f} {share:11.1%} {asyn['step_s_during_write']:23.3f} "
              f"{asyn['step_s_otherwise']:13.3f}")


if __name__ == "__main__":
    main()
