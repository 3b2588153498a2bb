"""HSDP inside a pipeline on 8 CPU ranks: pp2 x dp_replicate2 x dp_shard2, the mesh ``pp-core run``
builds. Not a pytest test because 8 gloo ranks take 40-60 s to start and run on a 2-core machine
(over the suite's budget); run by hand or in CI with cores to spare:

    .venv/bin/python benchmarks/check_hsdp.py

It runs the same case functions as the 4-rank tests (``tests/cases/fsdp.py``,
``tests/cases/dcp.py``): for 1f1b and zero_bubble, the loss and every full gradient against one
process on the global batch and the FSDP collectives per unit and step; then a DCP checkpoint of
the HSDP parts resumed at pp4 x fsdp2. Prints JSON (one line per check) and a markdown table;
exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]  # the tests package: its case functions

from pp_core.checkpoint import checkpoint_path  # noqa: E402
from pp_core.testing import DistPool  # noqa: E402
from tests.cases.dcp import check_resumed, merged, resume, train_and_save  # noqa: E402
from tests.cases.fsdp import dp_case  # noqa: E402

ATOL = 1e-5


def gradients(pool, schedule: str) -> dict:
    results = pool.run(dp_case, schedule, "helper", kind="gpt", hsdp=True)
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    once = all(r["counts"] == {"reduce_scatter_single": r["units"],
                               "all_gather_single": r["units"]} for r in results)
    worst = max(r["grad_err"] for r in results)
    return {"check": f"gradients {schedule}", "loss_err": max(losses), "grad_err": worst,
            "one_collective_per_unit": once,
            "ok": len(losses) == 4 and max(losses) <= ATOL and worst <= ATOL and once}


def checkpoint(pool) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        first = merged(pool.run(train_and_save, directory, (2, 2, 2), 2, 4))
        resumed = pool.run(resume, str(checkpoint_path(directory, 2)), (4, 1, 2), 4)
    try:
        check_resumed(resumed, first, 2, ATOL)
        ok, why = True, ""
    except AssertionError as exc:
        ok, why = False, str(exc)[:300]
    return {"check": "DCP pp2 x hsdp2x2 -> pp4 x fsdp2", "ok": ok, "why": why,
            "losses": resumed[0]["losses"], "expected": first["losses"][2:]}


def main() -> int:
    started = time.perf_counter()
    with DistPool(8, timeout=600) as pool:
        rows = [gradients(pool, "1f1b"), gradients(pool, "zero_bubble"), checkpoint(pool)]
    for row in rows:
        print(json.dumps(row))
    print("\n| check (8 ranks, pp2 x dp_replicate2 x dp_shard2) | result |\n|---|---|")
    for row in rows:
        detail = (f"loss {row['loss_err']:.1e}, grad {row['grad_err']:.1e}, one RS/AG per unit"
                  if "grad_err" in row else "losses and state equal")
        print(f"| {row['check']} | {'ok' if row['ok'] else 'FAILED'} ({detail}) |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
