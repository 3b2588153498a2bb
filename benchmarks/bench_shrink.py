"""What losing a node costs an elastic run: the time from the last step completed before the loss
to the first step completed at the smaller world, and its parts.

Run by hand (not part of the suite): ``python benchmarks/bench_shrink.py [--json FILE]``.

Two launches of ``pp-core run`` on this machine are two nodes (``distributed.nnodes: "1:2"``, 2
ranks each, c10d rendezvous on loopback): the tiny GPT at pp 2 x dp 2, a checkpoint every 4 steps,
``elastic_wait_s`` as given (default 3). As step 7 begins, a rank of the second launch SIGKILLs
its whole process group (the node is gone); the first goes on at pp 2 x dp 1. The run's own
account (the ``"event": "restart"`` line of its metrics file) gives the recovery and its parts:
down (the failure seen, the ranks stopped, the lost node declared dead after 5 s of missed
heartbeats, ``elastic_wait_s``, the new rendezvous), start and load (build, checkpoint read),
first step. Prints JSON (with the load average), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the tests package: a free port for the rendezvous

from tests.cases.specs import free_port  # noqa: E402

_CALLS = [0]

try:  # the model plugin, only where the run imports this module as the model's home
    from pp_core_builtins.models import GPT

    class NodeKiller(GPT):
        """``PP_BENCH_KILL_NODE=STEPS``: SIGKILL this launch's process group as step STEPS + 1
        begins (4 forwards a step at dp 2)."""

        def forward(self, x):
            _CALLS[0] += 1
            steps = os.environ.get("PP_BENCH_KILL_NODE")
            if steps and _CALLS[0] == int(steps) * 4 + 1:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            return super().forward(x)
except ImportError:  # pragma: no cover
    NodeKiller = None


def run(wait_s: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-shrink-"))
    spec = {
        "model": {"target": "benchmarks.bench_shrink:NodeKiller",
                  "args": {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2,
                           "max_seq_len": 8}},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 32}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "dp_size": 2, "device": "cpu", "nnodes": "1:2",
                        "master_port": free_port(), "max_restarts": 1, "timeout_s": 60,
                        "elastic_wait_s": wait_s},
        "train": {"steps": 8, "log_every": 1},
        "checkpoint": {"dir": str(tmp / "ckpt"), "every": 4},
        "output": {"metrics": str(tmp / "m.jsonl"), "progress": "plain", "summary": False},
    }
    path = tmp / "elastic.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {key: value for key, value in os.environ.items() if key != "PP_CORE_TIMEOUT"}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    command = [sys.executable, "-m", "pp_core", "run", str(path)]
    started = time.monotonic()
    node_a = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    node_b = subprocess.Popen([*command, "--set", "distributed.node_rank=1"], cwd=ROOT,
                              env={**env, "PP_BENCH_KILL_NODE": "6"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    node_b.wait(timeout=300)
    _, err = node_a.communicate(timeout=300)
    if node_a.returncode != 0:
        raise SystemExit(f"the surviving launch failed (rc {node_a.returncode}):\n{err[-3000:]}")
    lines = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    restart = next(line for line in lines if line.get("event") == "restart")
    return {"elastic_wait_s": wait_s, "wall_s": round(time.monotonic() - started, 1),
            **{k: restart[k] for k in ("recovery_s", "down_s", "startup_s", "first_step_s",
                                       "steps_redone")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elastic-wait", type=int, default=3)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args()
    before = os.getloadavg()[0]
    result = run(args.elastic_wait)
    out = {"load_before": round(before, 2), "load_after": round(os.getloadavg()[0], 2),
           "cpus": os.cpu_count(), "shrink": result}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(f"\n| lost node -> first step at pp 2 x dp 1 | down | start and load | first step | "
          f"steps redone |\n| --- | --- | --- | --- | --- |\n| {result['recovery_s']:.1f} s | "
          f"{result['down_s']:.1f} s | {result['startup_s']:.1f} s | "
          f"{result['first_step_s']:.2f} s | {result['steps_redone']} |")


if __name__ == "__main__":
    main()
