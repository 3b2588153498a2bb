"""Activation checkpointing chosen per stage against every stage ``full``, under a memory cap.

On 2 and 4 gloo ranks of this machine (one thread per rank), for a GPT whose saved activations
outweigh its parameters (long sequence, narrow model):

* the model is profiled once with the AC modes measured (``activation_checkpointing="auto"``);
* the **cap** is the largest fraction (0.99, 0.98, ...) of the smallest AC-free predicted peak at
  which the planner's chosen plan recomputes on some block stages and not on others: no AC-free
  plan fits it;
* **per stage**: the planner's chosen plan (schedule, microbatch size, split and AC per stage);
  **uniform**: the 3 fastest predicted plans with every stage ``full`` under the same cap (the
  planner picking schedule, microbatch size and split for the user's uniform setting: the best
  a hand layout could do), the fastest of them by measurement kept;
* each case runs ``rounds`` times, alternating (a burst of load from elsewhere hits all alike):
  the slowest rank's ``Pipeline.step`` per step (median), and each rank's live-tensor peak (one
  more untimed step + AdamW step under :mod:`pp_core.measure.transient`'s log, plus parameters
  and optimizer state) against the prediction and the cap; and the busiest rank's CPU time
  per step (median): the work a step puts on its busiest rank, which other processes' load
  stretches far less than the wall clock (the bubble is not in it).

    python benchmarks/bench_recompute.py [--ranks 2,4] [--steps 4] [--rounds 2] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

MODEL = {"vocab_size": 64, "dim": 64, "num_layers": 8, "num_heads": 4, "max_seq_len": 256}
BATCH, SEQ = 8, 256
FRACTIONS = (0.99, 0.98, 0.97, 0.96, 0.95, 0.93, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def make_model():
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(**MODEL)


def make_batch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=generator)
    y = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=generator)
    return x, y


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


def bench_pp(pp: int, steps: int, rounds: int, link) -> dict:
    from pp_core.measure.plan_auto import concrete_config
    from pp_core.planning.choose import choose_plan
    from pp_core.planning.report import describe, format_ranking
    from pp_core.testing import DistPool

    base, profiles = profiles_for(pp, link)
    free = choose_plan(profiles, pp, BATCH)
    lowest = min(c.peak_bytes for c in free.kept)
    chosen = cap = ranking = None
    for fraction in FRACTIONS:
        cap = int(lowest * fraction)
        ranking = choose_plan(profiles, pp, BATCH, memory_cap=cap,
                              activation_checkpointing="auto")
        if ranking.kept and len(set(block_modes(ranking.chosen))) > 1:
            chosen = ranking.chosen
            break
    if chosen is None:
        raise SystemExit(f"pp={pp}: no cap gave a mixed per-stage plan")
    print(format_ranking(ranking, top=4), flush=True)
    uniform = choose_plan(profiles, pp, BATCH, memory_cap=cap, activation_checkpointing="full")
    cases = [("per stage: " + describe(chosen), chosen)]
    cases += [(f"uniform full #{i + 1}: {describe(c)}", c) for i, c in enumerate(uniform.kept[:3])]
    times = {label: [] for label, _ in cases}
    cpu = {label: [] for label, _ in cases}
    lives = {label: [] for label, _ in cases}
    with DistPool(pp) as pool:
        for _ in range(rounds):
            for label, c in cases:
                values = concrete_config(base, c).to_dict()
                per_rank = pool.run(run_case, values, c.stage_modes(), steps)
                times[label] += [max(s) for s in zip(*(r["times"] for r in per_rank))]
                cpu[label] += [max(s) for s in zip(*(r["cpu"] for r in per_rank))]
                lives[label].append([r["live_peak_bytes"] for r in per_rank])
    rows = []
    for label, c in cases:
        live = [max(p) for p in zip(*lives[label])]
        predicted = [m.total(c.pool) for m in c.memory]
        rows.append({"label": label, "modes": c.stage_modes(),
                     "counts": [len(f) for f in c.fqns_per_stage],
                     "predicted_step_s": c.predicted_step_s,
                     "measured_step_s": statistics.median(times[label]),
                     "busiest_rank_cpu_s": statistics.median(cpu[label]),
                     "predicted_peak_bytes": predicted, "live_peak_bytes": live,
                     "live_over_predicted": [a / b for a, b in zip(live, predicted)],
                     "fits_cap": max(live) <= cap})
    best_uniform = min(rows[1:], key=lambda r: r["measured_step_s"])
    return {"pp": pp, "cap_bytes": cap, "lowest_ac_free_peak_bytes": lowest,
            "planning_s": ranking.planning_s, "rows": rows,
            "ratio": rows[0]["measured_step_s"] / best_uniform["measured_step_s"],
            "cpu_ratio": rows[0]["busiest_rank_cpu_s"] / min(
                r["busiest_rank_cpu_s"] for r in rows[1:]),
            "predicted_ratio": rows[0]["predicted_step_s"] / min(
                r["predicted_step_s"] for r in rows[1:])}


def table(report: dict) -> str:
    lines = []
    for entry in report["pp"]:
        lines.append(f"pp={entry['pp']}: cap {entry['cap_bytes'] / 2 ** 20:.2f} MiB "
                     f"(smallest AC-free peak {entry['lowest_ac_free_peak_bytes'] / 2 ** 20:.2f}"
                     f" MiB), planned in {entry['planning_s']:.2f} s; per stage / best uniform "
                     f"full: measured {entry['ratio']:.3f}x, busiest rank's CPU time "
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
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over all cases")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(__file__))
    from pp_core.measure.link import measure_local_link

    link = measure_local_link("gloo", "cpu")
    report = {"model": MODEL, "batch": BATCH, "seq_len": SEQ, "load_before": os.getloadavg(),
              "pp": []}
    for pp in (int(r) for r in args.ranks.split(",")):
        report["pp"].append(bench_pp(pp, args.steps, args.rounds, link))
    report["load_after"] = os.getloadavg()
    print(table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
