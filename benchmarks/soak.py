"""Soak: resident memory of every rank of a long ``pp-core run`` (1,000+ steps), start vs end.

Run by hand: ``python benchmarks/soak.py [--ranks 4] [--steps 1000] [--microbatches 64]
[--schedule 1f1b] [--warmup 100] [--json FILE]`` (a few minutes on 2 CPU cores).

The ranks are started as torchrun would start them (one ``python -m pp_core run FILE.yaml``
process per rank with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), so the script
knows each rank's process and reads its ``VmRSS`` from ``/proc/PID/status`` every 0.2 s while
the run trains a small GPT on the bundled text (metrics and progress on, trace and checkpoints
off). *start* is the first sample once rank 0's metrics say step ``--warmup`` is done (allocator
caches and lazy initialisation settle in the first steps); *end* the last sample before the last
step is logged (later, the run gathers its summary, which is not per-step memory). A run whose
per-step bookkeeping grows shows it here: the recorder once kept every action's time, ~8 KB per
step per rank at 64 microbatches. Prints JSON, then a table; exits 1 when a rank grew by more
than ``--limit-mib`` (default 1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from _common import options, write_json

MIB = 1024 * 1024
YAML = """\
model:
  name: gpt
  args: {{vocab_size: 256, dim: 16, num_layers: {layers}, num_heads: 2, max_seq_len: 16}}
data:
  name: text_bytes
  args: {{seq_len: 16}}
pipeline:
  pp_schedule: {schedule}
  pp_batch_size: {microbatches}
  pp_microbatch_size: 1
  loss_fn: cross_entropy
distributed: {{pp_size: {ranks}, dp_size: 1, device: cpu}}
train:
  steps: {steps}
  optimizer: {{name: AdamW, lr: 1.0e-3}}
  log_every: {log_every}
checkpoint: {{dir: null}}
output: {{metrics: {metrics}, trace: null, schedule_image: null, summary: false}}
"""


def rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def soak(ranks: int, steps: int, microbatches: int, schedule: str, warmup: int) -> dict:
    log_every = 10
    with tempfile.TemporaryDirectory(prefix="pp_core_soak_") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        spec = Path(tmp) / "soak.yaml"
        spec.write_text(YAML.format(layers=2 * ranks, schedule=schedule, ranks=ranks,
                                    microbatches=microbatches, steps=steps, log_every=log_every,
                                    metrics=json.dumps(str(metrics))))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a free loopback port
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, "-m", "pp_core", "run", str(spec)],
                                          env=env, stdout=subprocess.DEVNULL if rank else None,
                                          stderr=subprocess.STDOUT if rank else None))
        started = time.monotonic()
        start = end = None
        while any(proc.poll() is None for proc in procs):
            step = last_step(metrics)
            sample = [rss(proc.pid) for proc in procs]
            if None not in sample and step < steps:
                if start is None and step >= warmup:
                    start = (step, sample)
                if start is not None:
                    end = (step, sample)
            time.sleep(0.2)
        codes = [proc.returncode for proc in procs]
    if any(codes) or start is None or end is None or end[0] <= start[0]:
        raise SystemExit(f"the run failed or was too short to measure (exit codes {codes}, "
                         f"start {start and start[0]}, end {end and end[0]})")
    return {
        "ranks": ranks, "steps": steps, "microbatches": microbatches, "schedule": schedule,
        "wall_s": round(time.monotonic() - started, 1), "start_step": start[0],
        "end_step": end[0],
        "per_rank": [{"rank": r, "rss_start_mib": round(start[1][r] / MIB, 2),
                      "rss_end_mib": round(end[1][r] / MIB, 2),
                      "growth_mib": round((end[1][r] - start[1][r]) / MIB, 2),
                      "growth_bytes_per_step": round((end[1][r] - start[1][r])
                                                     / (end[0] - start[0]))}
                     for r in range(ranks)],
    }


def main(argv=None) -> int:
    args = options(__doc__, ranks=4, steps=1000, microbatches=64, schedule="1f1b", warmup=100,
                   limit_mib=1.0, json=None).parse_args(argv)
    report = soak(args.ranks, args.steps, args.microbatches, args.schedule, args.warmup)
    print(write_json(args.json, report, indent=2))
    print(f"\n{report['ranks']} ranks, {report['schedule']}, {report['microbatches']} microbatches,"
          f" RSS from step {report['start_step']} to step {report['end_step']} "
          f"({report['wall_s']} s)\n")
    print("| rank | RSS start MiB | RSS end MiB | growth MiB | bytes/step |")
    print("|---|---|---|---|---|")
    for r in report["per_rank"]:
        print(f"| {r['rank']} | {r['rss_start_mib']:.2f} | {r['rss_end_mib']:.2f} | "
              f"{r['growth_mib']:+.2f} | {r['growth_bytes_per_step']:+d} |")
    grown = [r["rank"] for r in report["per_rank"] if r["growth_mib"] > args.limit_mib]
    if grown:
        print(f"\nranks {grown} grew by more than {args.limit_mib} MiB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
