"""Activation checkpointing chosen per stage against every stage ``full``, under a memory cap.

On 2 and 4 gloo ranks of this machine (one thread per rank), for a GPT whose saved activations
outweigh its parameters (long sequence, narrow model):

* the model is profiled once with the AC modes measured (``activation_checkpointing="auto"``);
* the **cap** is the fraction (0.99, 0.97, ... 0.51) of the smallest AC-free predicted peak
  - so no AC-free plan fits it - at which the planner's chosen plan recomputes on some block
  stages and not on others and is predicted to gain the most over every stage ``full``: where
  memory binds so that choosing per stage matters (at most fractions it changes one stage);
* **per stage**: the planner's chosen plan (schedule, microbatch size, split and AC per stage);
  **uniform**: the ``--uniform-plans`` fastest predicted plans with every stage ``full`` under
  the same cap (the planner picking schedule, microbatch size and split for the user's uniform
  setting: the best a hand layout could do), the fastest of them by measurement kept;
* the cases run in turn, ``rounds`` times (A B B' A B B' ...: drift in the machine's load hits
  every case alike): per step the slowest rank's ``Pipeline.step``; the ratio is reported as
  the median over all steps and as the median of the per-round ratios (each round's A against
  its neighbouring B); each rank's live-tensor peak (one more untimed step + AdamW step under
  :mod:`pp_core.measure.transient`'s log, plus parameters and optimizer state) against the
  prediction and the cap; and the busiest rank's CPU time per step (median): the work a step
  puts on its busiest rank, which other processes' load stretches far less than the wall clock
  (the bubble is not in it).

    python benchmarks/bench_recompute.py [--ranks 2,4] [--steps 3] [--rounds 5] [--json out]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _common import random_batch, seeded_gpt, write_json

MODEL = {"vocab_size": 64, "dim": 64, "num_layers": 8, "num_heads": 4, "max_seq_len": 256}
BATCH, SEQ = 8, 256
FRACTIONS = tuple(round(0.99 - 0.02 * i, 2) for i in range(25))  # 0.99 ... 0.51


def make_model():
    return seeded_gpt(MODEL)


def make_batch():
    return random_batch(MODEL["vocab_size"], BATCH, SEQ)


def run_case(values: dict, modes: list[str], steps: int, warmup: int = 1) -> dict:
    """On every rank: the pipeline with each stage's AC, timed steps, then the live peak."""
    import torch.distributed as dist

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.parallel.activation import apply_stage_checkpointing

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_planner import live_peak  # the live-tensor figure every memory benchmark reads

    torch.set_num_threads(1)
    x, y = make_batch()
    pipe = build_pipeline(make_model(), PipelineConfig(**values))
    apply_stage_checkpointing(pipe.model_parts, pipe.stage_indices, modes)
    params = sum(p.numel() * p.element_size() for part in pipe.model_parts
                 for p in part.parameters())
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3) for part in pipe.model_parts]
    times, cpu = [], []
    for _ in range(warmup + steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        pipe.step(x, target=y)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        for optimizer in optimizers:
            optimizer.step()
    return {"times": times[warmup:], "cpu": cpu[warmup:],
            "live_peak_bytes": live_peak(pipe, optimizers, x, y, params)}


def block_modes(candidate) -> list[str]:
    return [m for m, fqns in zip(candidate.stage_modes(), candidate.fqns_per_stage)
            if any(f.startswith("layers.") for f in fqns)]


def profiles_for(pp: int, link):
    """The model profiled once with every AC mode, its processors set for ``pp`` ranks."""
    import dataclasses

    from pp_core import PipelineConfig, plan_auto

    x, y = make_batch()
    torch.set_num_threads(1)
    base = PipelineConfig(pp_schedule="auto", pp_batch_size=BATCH, loss_fn="cross_entropy")
    started = time.perf_counter()
    plan = plan_auto(make_model(), base, x, y, pp, link=link, microbatch_sizes=[1, 2],
                     repeats=3, activation_checkpointing="auto")
    print(f"pp={pp}: profiled in {time.perf_counter() - started:.1f} s "
          f"(processors {plan.processors})", flush=True)
    return base, {size: dataclasses.replace(p) for size, p in plan.profiles.items()}


def paired_ratios(per_round: dict, label: str, against: str) -> list[float]:
    """Per round, ``label``'s median step over ``against``'s: the two ran back to back, so
    drift in the machine's load between rounds cancels out of each ratio."""
    return [statistics.median(a) / statistics.median(b)
            for a, b in zip(per_round[label], per_round[against])]


def bench_pp(pp: int, steps: int, rounds: int, link, uniform_plans: int) -> dict:
    from pp_core.measure.plan_auto import concrete_config
    from pp_core.planning.choose import choose_plan
    from pp_core.planning.report import describe, format_ranking
    from pp_core.testing import DistPool

    base, profiles = profiles_for(pp, link)
    free = choose_plan(profiles, pp, BATCH)
    lowest = min(c.peak_bytes for c in free.kept)
    best = None  # (predicted per-stage / uniform, cap, fraction, auto ranking, uniform ranking)
    for fraction in FRACTIONS:
        cap = int(lowest * fraction)
        ranking = choose_plan(profiles, pp, BATCH, memory_cap=cap,
                              activation_checkpointing="auto")
        uniform = choose_plan(profiles, pp, BATCH, memory_cap=cap,
                              activation_checkpointing="full")
        if not (ranking.kept and uniform.kept):
            print(f"pp={pp}: cap {fraction:.2f}: nothing fits", flush=True)
            continue
        ratio = ranking.chosen.predicted_step_s / uniform.chosen.predicted_step_s
        mixed = len(set(block_modes(ranking.chosen))) > 1
        print(f"pp={pp}: cap {fraction:.2f} x {lowest / 2 ** 20:.2f} MiB: "
              f"{describe(ranking.chosen)}, predicted {ratio:.3f}x uniform full"
              + ("" if mixed else " (not mixed)"), flush=True)
        if mixed and (best is None or ratio < best[0]):
            best = (ratio, cap, fraction, ranking, uniform)
    if best is None:
        print(f"pp={pp}: no cap gave a mixed per-stage plan", flush=True)
        return None
    _, cap, fraction, ranking, uniform = best
    chosen = ranking.chosen
    print(format_ranking(ranking, top=4), flush=True)
    cases = [("per stage: " + describe(chosen), chosen)]
    cases += [(f"uniform full #{i + 1}: {describe(c)}", c)
              for i, c in enumerate(uniform.kept[:uniform_plans])]
    per_round = {label: [] for label, _ in cases}  # per round, the slowest rank's step times
    cpu = {label: [] for label, _ in cases}
    lives = {label: [] for label, _ in cases}
    with DistPool(pp) as pool:
        for _ in range(rounds):  # A B B' A B B' ...: drift hits every case alike
            for label, c in cases:
                values = concrete_config(base, c).to_dict()
                per_rank = pool.run(run_case, values, c.stage_modes(), steps)
                per_round[label].append([max(s) for s in zip(*(r["times"] for r in per_rank))])
                cpu[label] += [max(s) for s in zip(*(r["cpu"] for r in per_rank))]
                lives[label].append([r["live_peak_bytes"] for r in per_rank])
    rows = []
    for label, c in cases:
        live = [max(p) for p in zip(*lives[label])]
        predicted = [m.total(c.pool) for m in c.memory]
        over = [a / b for a, b in zip(live, predicted)]
        rows.append({"label": label, "modes": c.stage_modes(),
                     "counts": [len(f) for f in c.fqns_per_stage],
                     "predicted_step_s": c.predicted_step_s,
                     "measured_step_s": statistics.median(
                         [t for times in per_round[label] for t in times]),
                     "round_medians_s": [statistics.median(t) for t in per_round[label]],
                     "busiest_rank_cpu_s": statistics.median(cpu[label]),
                     "predicted_peak_bytes": predicted, "live_peak_bytes": live,
                     "live_over_predicted": over, "fits_cap": max(live) <= cap,
                     "within_10_percent": all(0.9 <= r <= 1.1 for r in over)})
    fastest = min(rows[1:], key=lambda r: r["measured_step_s"])
    paired = paired_ratios(per_round, rows[0]["label"], fastest["label"])
    return {"pp": pp, "cap_bytes": cap, "cap_fraction": fraction,
            "lowest_ac_free_peak_bytes": lowest,
            "planning_s": ranking.planning_s, "rows": rows, "best_uniform": fastest["label"],
            "ratio": rows[0]["measured_step_s"] / fastest["measured_step_s"],
            "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
            "cpu_ratio": rows[0]["busiest_rank_cpu_s"] / fastest["busiest_rank_cpu_s"],
            "predicted_ratio": rows[0]["predicted_step_s"] / min(
                r["predicted_step_s"] for r in rows[1:])}


def table(report: dict) -> str:
    lines = []
    for entry in report["pp"]:
        lines.append(f"pp={entry['pp']}: cap {entry['cap_bytes'] / 2 ** 20:.2f} MiB "
                     f"(smallest AC-free peak {entry['lowest_ac_free_peak_bytes'] / 2 ** 20:.2f}"
                     f" MiB), planned in {entry['planning_s']:.2f} s; per stage / best uniform "
                     f"full: measured {entry['ratio']:.3f}x (median of per-round pairs "
                     f"{entry['paired_ratio_median']:.3f}x), busiest rank's CPU time "
                     f"{entry['cpu_ratio']:.3f}x, predicted {entry['predicted_ratio']:.3f}x")
        lines.append("| plan | AC per stage | units per stage | predicted ms | measured ms | "
                     "busiest rank CPU ms | live peak per rank MiB | live / predicted | "
                     "within cap |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for row in entry["rows"]:
            lines.append(
                f"| {row['label']} | {' '.join(row['modes'])} | {row['counts']} | "
                f"{row['predicted_step_s'] * 1e3:.1f} | {row['measured_step_s'] * 1e3:.1f} | "
                f"{row['busiest_rank_cpu_s'] * 1e3:.1f} | "
                + " ".join(f"{b / 2 ** 20:.2f}" for b in row["live_peak_bytes"]) + " | "
                + " ".join(f"{r:.2f}" for r in row["live_over_predicted"])
                + f" | {row['fits_cap']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=5, help="passes over all cases")
    parser.add_argument("--uniform-plans", type=int, default=2,
                        help="the fastest predicted uniform-full plans run (the fastest measured "
                             "counts)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(__file__))
    from pp_core.measure.link import measure_local_link

    link = measure_local_link("gloo", "cpu")
    report = {"model": MODEL, "batch": BATCH, "seq_len": SEQ, "load_before": os.getloadavg(),
              "pp": []}
    for pp in (int(r) for r in args.ranks.split(",")):
        entry = bench_pp(pp, args.steps, args.rounds, link, args.uniform_plans)
        if entry is None:
            report.setdefault("no_mixed_plan", []).append(pp)
            continue
        report["pp"].append(entry)
        report["load_after"] = os.getloadavg()
        print(table({"pp": [entry]}), flush=True)  # each as it ends: a later one may fail
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
