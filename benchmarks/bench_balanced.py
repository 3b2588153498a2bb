"""The ``balanced`` splitter against the ``layers`` split, same model, schedule and ranks.

Model: ``uneven_gpt`` (pp_core_builtins.models): vocabulary 16384 (``--vocab``), dim 128,
8 blocks - 4 with MLP factor 1, then 4 with factor 8 (``--wide``) - so the head and the wide
blocks cost far more than the embedding and the narrow blocks. With 4 one-thread ranks on a
2-core machine a split can only win where the block-count split leaves more than half the work
on one rank (else the step is bound by the total work over the 2 cores, whatever the split):
the large vocabulary makes the head that heavy, as it is in LLMs with 100k-250k vocabularies.
``layers`` spreads blocks by count; ``balanced`` cuts by the forward + backward time
``profile_model`` measures, once, in this (parent) process before the ranks start - as
``pp-core run`` does for ``model.splitter: balanced`` - so every rank gets the same cut.

Each configuration (ranks x schedule) builds both pipelines from the same weights on gloo ranks
(CPU, one thread per rank) and alternates them step by step (which goes first alternates too,
so neither always runs right after the other); a step is ``pipe.step`` plus the
AdamW step, from a common barrier to the slowest rank. Reported: the median step time of each
split and the ratio balanced / layers; the median cpu time of the busiest rank per step and its
ratio (on a shared machine the wall time also holds the waits for a core; the cpu time is the
work each split leaves on its busiest rank); the slowest stage's forward + backward time per
microbatch each split has by the profile (what the split balances).

    python benchmarks/bench_balanced.py [--ranks 2,4] [--schedules 1f1b,interleaved_1f1b]
                                        [--steps 12] [--seq 64] [--microbatch 2] [--json FILE]
                                        [--microbatches 8] [--vocab 16384] [--wide 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import write_json

MODEL = {"vocab_size": 16384, "dim": 128, "num_layers": 8, "num_heads": 4, "narrow": 1,
         "wide": 8}
MICROBATCHES = 8


def make_model(setup):
    from pp_core_builtins.models.gpt import uneven_gpt

    torch.manual_seed(0)
    return uneven_gpt(**{**MODEL, "vocab_size": setup["vocab"], "wide": setup["wide"]},
                      max_seq_len=setup["seq"])


def batch(setup):
    tokens = torch.randint(0, setup["vocab"], (setup["microbatch"] * setup["microbatches"],
                                                    setup["seq"]),
                           generator=torch.Generator().manual_seed(1))
    return tokens, tokens


def config(setup, schedule, fqns=None):
    from pp_core import PipelineConfig

    return PipelineConfig(pp_schedule=schedule, pp_microbatch_size=setup["microbatch"],
                          pp_batch_size=setup["microbatch"] * setup["microbatches"],
                          loss_fn="cross_entropy", module_fqns_per_model_part=fqns)


def stages_per_rank(schedule):
    from pp_core.plugin_manager import default_plugins
    from pp_core.schedule.build import resolve_schedule_def

    return resolve_schedule_def(schedule, default_plugins())[1].stages_per_rank


def stage_seconds(profile, fqns_per_stage):
    """Forward + backward seconds per stage of a split, by the profile."""
    unit_of = {fqn: index for index, unit in enumerate(profile.units) for fqn in unit.fqns}
    costs = [unit.forward_s + unit.backward_s for unit in profile.units]
    return [sum(costs[i] for i in {unit_of[fqn] for fqn in stage if fqn in unit_of})
            for stage in fqns_per_stage]


def timed_step(pipe, optimizers, inputs, target):
    """``(wall s, busiest rank's cpu s)`` of one step: wall from a common barrier to the
    slowest rank; cpu is what the busiest rank computed (a wait for a peer or for a core on a
    shared machine costs no cpu), so it shows the split's balance whatever the machine's load."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    pipe.step(inputs, target=target)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu],
                           dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()


def build(setup, schedule, fqns):
    from pp_core import build_pipeline

    cfg = config(setup, schedule, fqns)
    pipe = build_pipeline(make_model(setup), cfg, splitter=None if fqns else "layers")
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3) for part in pipe.model_parts
                  if any(True for _ in part.parameters())]
    return pipe, optimizers


def worker(rank, num_ranks, store, setup, cases, steps, results_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=num_ranks)
    inputs, target = batch(setup)
    out = []
    for schedule, fqns in cases:
        runs = {"layers": build(setup, schedule, None),
                "balanced": build(setup, schedule, fqns)}
        times = {name: [] for name in runs}
        for step in range(steps + 2):  # two warm-up steps each, then alternate
            for name in sorted(runs, reverse=bool(step % 2)):  # who goes first alternates too
                pipe, optimizers = runs[name]
                wall_cpu = timed_step(pipe, optimizers, inputs, target)
                if step >= 2:
                    times[name].append(wall_cpu)
        out.append({"schedule": schedule, "times": times})
    if rank == 0:
        with open(results_path, "w") as handle:
            json.dump(out, handle)
    dist.destroy_process_group()


def run(setup, num_ranks, schedules, steps, profile):
    from pp_core.planning.balance import split_by_profile
    from pp_core.planning.split import plan_split

    cases, rows = [], []
    for schedule in schedules:
        num_stages = num_ranks * stages_per_rank(schedule)
        balanced = split_by_profile(profile, num_stages)
        layers = plan_split(make_model(setup), config(setup, schedule), num_ranks,
                            stages_per_rank(schedule), splitter="layers").fqns_per_stage
        cases.append((schedule, balanced))
        rows.append({"ranks": num_ranks, "schedule": schedule, "stages": num_stages,
                     "balanced_fqns": balanced, "layers_fqns": layers,
                     "layers_slowest_stage_ms": max(stage_seconds(profile, layers)) * 1e3,
                     "balanced_slowest_stage_ms": max(stage_seconds(profile, balanced)) * 1e3})
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(num_ranks, os.path.join(tmp, "store"), setup, cases, steps,
                               results),
                 nprocs=num_ranks, join=True)
        with open(results) as handle:
            measured = json.load(handle)
    for row, found in zip(rows, measured):
        for name in ("layers", "balanced"):
            walls, cpus = zip(*found["times"][name])
            row[f"{name}_step_ms"] = statistics.median(walls) * 1e3
            row[f"{name}_busiest_cpu_ms"] = statistics.median(cpus) * 1e3
        row.update(ratio=row["balanced_step_ms"] / row["layers_step_ms"],
                   cpu_ratio=row["balanced_busiest_cpu_ms"] / row["layers_busiest_cpu_ms"],
                   steps=steps)
    return rows


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--schedules", default="1f1b,interleaved_1f1b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--vocab", type=int, default=MODEL["vocab_size"])
    parser.add_argument("--wide", type=int, default=MODEL["wide"], help="MLP factor, wide blocks")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    setup = {"seq": args.seq, "microbatch": args.microbatch, "vocab": args.vocab,
             "wide": args.wide, "microbatches": args.microbatches}
    from pp_core.losses import cross_entropy
    from pp_core.measure.profile import profile_model

    torch.set_num_threads(1)
    load_before = uptime()
    started = time.perf_counter()
    inputs, target = batch(setup)
    size = setup["microbatch"]
    profile = profile_model(make_model(setup), inputs, target, cross_entropy, [size])[size]
    profile_s = time.perf_counter() - started
    rows = []
    for num_ranks in map(int, args.ranks.split(",")):
        rows += run(setup, num_ranks, args.schedules.split(","), args.steps, profile)
    report = {"model": {**MODEL, "vocab_size": args.vocab, "wide": args.wide}, **setup,
              "profile_s": profile_s,
              "unit_ms": [round((u.forward_s + u.backward_s) * 1e3, 3) for u in profile.units],
              "load_before": load_before, "load_after": uptime(), "rows": rows}
    print(json.dumps(report, indent=1))
    write_json(args.json, report)
    print(f"\nprofile: {profile_s:.2f} s; F+B per unit (ms): {report['unit_ms']}")
    print("step time (wall, median) and the busiest rank's cpu time per step, layers -> "
          "balanced; slowest stage's F+B per microbatch by the profile")
    print(f"{'ranks':>5} {'schedule':<17} {'step ms':>17} {'ratio':>6} {'busiest cpu ms':>17} "
          f"{'ratio':>6} {'slowest stage ms':>17}")
    for row in rows:
        print(f"{row['ranks']:>5} {row['schedule']:<17} "
              f"{row['layers_step_ms']:>7.1f} -> {row['balanced_step_ms']:>6.1f} "
              f"{row['ratio']:>6.3f} "
              f"{row['layers_busiest_cpu_ms']:>7.1f} -> {row['balanced_busiest_cpu_ms']:>6.1f} "
              f"{row['cpu_ratio']:>6.3f} "
              f"{row['layers_slowest_stage_ms']:>7.2f} -> {row['balanced_slowest_stage_ms']:>6.2f}")
    print(f"load: before {load_before}\n      after  {report['load_after']}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
