"""Grow back, checked by hand (too slow for the suite): a run with ``nnodes: "1:2"`` that starts
on one node goes on at pp 2 x dp 1, and when the second node comes the group grows to pp 2 x dp 2
from the latest checkpoint, with the losses of a run at pp 2 x dp 2 from the start.

``python benchmarks/check_grow_back.py`` - two launches of ``pp-core run`` on this machine are
the nodes (2 ranks each, c10d rendezvous on loopback), the tiny GPT, 400 steps, a checkpoint
every 10; the second launch (``node_rank: 1``) starts 4 s after the first. Prints JSON: the
layouts each launch reported, the step the grown group resumed from, and the largest difference
of a step's loss from the reference run's (expected < 1e-5). Exit 1 when it is not so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the tests package: the tiny GPT's pipeline file

from tests.cases.specs import free_port, tiny_gpt_spec, write_spec  # noqa: E402

STEPS, EVERY = 400, 10


def _spec(tmp: Path, name: str, **distributed) -> Path:
    spec = tiny_gpt_spec(
        distributed={"dp_size": 2, "device": "cpu", **distributed},
        train={"steps": STEPS, "log_every": 1},
        checkpoint={"dir": str(tmp / name), "every": EVERY},
        output={"metrics": str(tmp / f"{name}.jsonl"), "progress": "plain"})
    return write_spec(tmp / f"{name}.yaml", spec)


def _losses(path: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="check-grow-"))
    env = {key: value for key, value in os.environ.items() if key != "PP_CORE_TIMEOUT"}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    run = [sys.executable, "-m", "pp_core", "run"]
    reference = subprocess.run([*run, str(_spec(tmp, "reference"))], cwd=ROOT, env=env,
                               capture_output=True, text=True)
    if reference.returncode:
        print(reference.stderr[-3000:])
        return 1
    path = _spec(tmp, "grow", nnodes="1:2", master_port=free_port(), max_restarts=1,
                 timeout_s=60, elastic_wait_s=2)
    first = subprocess.Popen([*run, str(path)], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(4)
    second = subprocess.Popen([*run, str(path), "--set", "distributed.node_rank=1"], cwd=ROOT,
                              env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    out_a, err_a = first.communicate(timeout=600)
    out_b, err_b = second.communicate(timeout=600)
    text = out_a + out_b
    want, found = _losses(tmp / "reference.jsonl"), _losses(tmp / "grow.jsonl")
    worst = max((abs(want[k] - found[k]) for k in want if k in found), default=None)
    result = {
        "rc": [first.returncode, second.returncode],
        "layouts": [line for line in text.splitlines() if "rendezvous gave" in line
                    or "building the model and its pipeline" in line],
        "resumed": [line for line in text.splitlines() if line.startswith("resumed from")],
        "steps_logged": len(found), "max_loss_difference": worst,
    }
    print(json.dumps(result, indent=2))
    ok = result["rc"] == [0, 0] and len(found) == STEPS and worst is not None and worst < 1e-5
    if not ok:
        print(err_a[-2000:], err_b[-2000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
