"""Start-up of the schedule commands: wall and CPU time of a fresh ``pp-core`` process, and torch.

    python benchmarks/bench_cli_startup.py                  # 10 runs per command
    python benchmarks/bench_cli_startup.py --runs 20 --json out.json

Runs this environment's ``pp-core`` script (every installed plugin loads, as for a user) for

- ``schedule show 1f1b --pp 2 --microbatches 4``: almost no schedule work, so start-up alone;
- ``schedule simulate 1f1b --pp 32000 --microbatches 1``: start-up plus linear schedule work
  (``bench_schedules.py --scale-only`` splits the work up);

and reports per command the median, min and max wall seconds, the median CPU seconds (user +
system of the child; steadier than wall on a shared machine), and whether the command imported
torch (one more run under ``python -X importtime``). The load average before and after is part
of the report: on a busy machine the wall figures grow with it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from _common import write_json

PP_CORE = str(Path(sysconfig.get_path("scripts")) / "pp-core")
COMMANDS = {
    "show pp=2": ["schedule", "show", "1f1b", "--pp", "2", "--microbatches", "4"],
    "simulate pp=32000": ["schedule", "simulate", "1f1b", "--pp", "32000", "--microbatches", "1"],
}


def _run_once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh ``pp-core`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([PP_CORE, *argv], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def imports_torch(argv: list[str]) -> bool:
    done = subprocess.run([sys.executable, "-X", "importtime", PP_CORE, *argv], check=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines())


def measure(label: str, argv: list[str], runs: int) -> dict:
    _run_once(argv)  # warm the file cache; not counted
    walls, cpus = zip(*(_run_once(argv) for _ in range(runs)))
    return {"command": label, "argv": argv, "runs": runs,
            "wall_median_s": round(statistics.median(walls), 3),
            "wall_min_s": round(min(walls), 3), "wall_max_s": round(max(walls), 3),
            "cpu_median_s": round(statistics.median(cpus), 3),
            "imports_torch": imports_torch(argv)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per command (default 10)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = [measure(label, command, args.runs) for label, command in COMMANDS.items()]
    report = {"pp_core": PP_CORE, "cpus": os.cpu_count(),
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    print(write_json(args.json, report))
    print()
    columns = ["command", "wall_median_s", "wall_min_s", "wall_max_s", "cpu_median_s",
               "imports_torch"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    print(f"load average (1, 5, 15 min): {report['load_average_before']} before, "
          f"{report['load_average_after']} after, {report['cpus']} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
