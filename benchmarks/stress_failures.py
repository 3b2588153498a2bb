"""Stress the failure paths: run tests/runtime/test_runtime_errors.py many times under parallel load.

Run by hand (not part of the suite): ``python benchmarks/stress_failures.py [--rounds 200]
[--workers 3] [--burners 2] [--timeout 60] [--only NAME ...] [--json FILE]``.

A refused or failed step must end every rank, whatever the timing. One pass of the check runs
every test of ``tests/runtime/test_runtime_errors.py`` (3 gloo ranks each: a rank that raises, one that
stalls, one that dies, misuse refused before traffic, ...). ``--rounds`` passes are shared by
``--workers`` concurrent worker processes, each with its own pool of ranks (started once, as
the suite does), while ``--burners`` processes spin on the CPU, so the ranks of one case are
descheduled at random points. A case whose ranks do not all finish within ``--timeout``
seconds is a *hang* (the pool kills its ranks and starts new ones, as in the suite). Prints
JSON, then a table; exits 1 on any hang or failure.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path
from _common import options, write_json

ROOT = Path(__file__).resolve().parent.parent


def _cases(only):
    sys.path.insert(0, str(ROOT))  # the tests package
    from tests.runtime import test_runtime_errors as module

    cases = [(name, fn) for name, fn in vars(module).items()
             if name.startswith("test_") and callable(fn)]
    return [(n, f) for n, f in cases if not only or n in only]


def _worker(index: int, rounds: int, timeout: float, only, results) -> None:
    from pp_core.testing.dist_pool import DistPool

    cases = _cases(only)
    counts = {name: {"passed": 0, "failed": 0, "hangs": 0} for name, _ in cases}
    problems = []
    with DistPool(3, timeout=timeout) as pool:
        for round_index in range(rounds):
            for name, fn in cases:
                try:
                    if "pool" in inspect.signature(fn).parameters:
                        fn(pool)
                    else:
                        fn()
                    counts[name]["passed"] += 1
                except Exception as exc:
                    hang = "(a hang)" in str(exc)
                    counts[name]["hangs" if hang else "failed"] += 1
                    problems.append({"worker": index, "round": round_index, "test": name,
                                     "hang": hang, "error": traceback.format_exc()[-2000:]})
            done = sum(sum(c.values()) for c in counts.values())
            bad = sum(c["failed"] + c["hangs"] for c in counts.values())
            print(f"worker {index}: round {round_index + 1}/{rounds}, {done} cases, {bad} not "
                  f"passed", file=sys.stderr, flush=True)
    results.put((index, counts, problems))


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def stress(rounds: int, workers: int, burners: int, timeout: float, only) -> dict:
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    burn = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    shares = [rounds // workers + (i < rounds % workers) for i in range(workers)]
    procs = [ctx.Process(target=_worker, args=(i, shares[i], timeout, only, results))
             for i in range(workers) if shares[i]]
    started = time.monotonic()
    for proc in burn + procs:
        proc.start()
    gathered = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    stop.set()
    for proc in burn:
        proc.join(timeout=5)
    totals: dict[str, dict[str, int]] = {}
    problems = []
    for _, counts, found in gathered:
        problems += found
        for name, c in counts.items():
            total = totals.setdefault(name, {"passed": 0, "failed": 0, "hangs": 0})
            for key in total:
                total[key] += c[key]
    return {"rounds": rounds, "workers": len(procs), "burners": burners, "timeout_s": timeout,
            "wall_s": round(time.monotonic() - started, 1),
            "cases": sum(sum(c.values()) for c in totals.values()),
            "passed": sum(c["passed"] for c in totals.values()),
            "failed": sum(c["failed"] for c in totals.values()),
            "hangs": sum(c["hangs"] for c in totals.values()),
            "per_test": totals, "problems": problems[:20]}


def main(argv=None) -> int:
    parser = options(__doc__, rounds=200, workers=3, burners=2, timeout=60.0, json=None)
    parser.add_argument("--only", nargs="*", help="test names (default: every test of the file)")
    args = parser.parse_args(argv)
    report = stress(args.rounds, args.workers, args.burners, args.timeout, args.only)
    print(write_json(args.json, report, indent=2))
    print(f"\n{report['rounds']} rounds on {report['workers']} workers + {report['burners']} "
          f"CPU burners, {report['wall_s']} s: {report['cases']} cases, {report['passed']} "
          f"passed, {report['failed']} failed, hangs={report['hangs']}\n")
    print("| test | passed | failed | hangs |")
    print("|---|---|---|---|")
    for name, c in report["per_test"].items():
        print(f"| {name} | {c['passed']} | {c['failed']} | {c['hangs']} |")
    return 1 if report["hangs"] or report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
