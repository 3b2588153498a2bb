"""The planner (``pp_schedule: auto``) against the plans it predicts and the ones a user picks.

On 2 and 4 gloo ranks of this machine (one thread per rank), for a GPT with a large vocabulary
(embedding and head heavier than a block):

* **prediction**: every plan that is run gets the planner's predicted pipeline step
  (``pp_core.planning.choose.predict`` on the profile, with that plan's own split) next to the
  measured one (median over the timed steps of the slowest rank's ``Pipeline.step``);
* **auto vs by hand**: the plan auto chooses, run, against every built-in schedule at its
  default stages per rank with the ``layers`` splitter (what a user writes by hand), at two
  microbatch sizes (auto's and the one giving 2 x pp microbatches); ratio auto / best by hand,
  then again from a second pass that runs only auto and the 3 fastest by hand, alternating (the
  best of twenty noisy medians is biased low; the second pass is not);
* **ranks sharing cores**: at pp=4 on a 2-core machine the planner predicts with the
  processor-sharing replay (``processors`` in the report);
* **memory cap**: a cap just below the fastest plan's predicted peak; the plan auto picks then,
  run, with its measured peak per rank (parameters of the rank's parts + the growth of the
  resident set over the steps, optimizer steps included) and what it gave up; every run also
  records its live-tensor peak (one more untimed step under :mod:`pp_core.measure.transient`'s
  log: what the memory model predicts, without the allocator's retained pages); the capped
  plan is run once more on ranks whose allocator returns freed pages (``MALLOC_MMAP_THRESHOLD_``),
  where the resident set follows the live tensors;
* **planning time** at pp=8 with every installed schedule (profile excluded);
* ``--world N``: the whole layout chosen instead (``benchmarks/bench_planner_layouts.py``).

    python benchmarks/bench_planner.py [--ranks 2,4] [--steps 6] [--json out.json]
    python benchmarks/bench_planner.py --world 4 --json layouts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from _common import random_batch, seeded_gpt, write_json

MODEL = {"vocab_size": 4096, "dim": 128, "num_layers": 6, "num_heads": 4, "max_seq_len": 64}
BATCH, SEQ = 16, 64


def make_model():
    return seeded_gpt(MODEL)


def make_batch():
    return random_batch(MODEL["vocab_size"], BATCH, SEQ)


def run_case(config_values: dict, steps: int, warmup: int = 2) -> dict:
    """On every rank: build the pipeline, time ``Pipeline.step`` (+ AdamW), measure memory."""
    import ctypes
    import gc

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    from _common import proc_status, reset_peak

    from pp_core import PipelineConfig, build_pipeline

    x, y = make_batch()
    _warm_runtime(config_values, x, y)
    model = make_model()
    pipe = build_pipeline(model, PipelineConfig(**config_values))
    del model
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the whole model's pages back to the OS: the
    # growth below is then this rank's own (grads, optimizer state, activations, buffers)
    params = sum(p.numel() * p.element_size() for part in pipe.model_parts
                 for p in part.parameters())
    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3) for part in pipe.model_parts
                  if any(True for _ in part.parameters())]
    reset_peak()
    baseline = proc_status("VmRSS")
    times = []
    for step in range(warmup + steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        times.append(time.perf_counter() - t0)
        for optimizer in optimizers:
            optimizer.step()
    peak = params + proc_status("VmHWM") - baseline
    return {"times": times[warmup:], "peak_bytes": peak, "stages": list(pipe.stage_indices),
            "live_peak_bytes": live_peak(pipe, optimizers, x, y, params)}


def live_peak(pipe, optimizers, x, y, params: int) -> int:
    """The most bytes of live tensors in one more (untimed) step and optimizer step: parameters,
    optimizer state, and what the step makes (pp_core.measure.transient's log). What the memory
    model predicts, without the allocator's retained pages that the resident set adds."""
    import torch.distributed as dist

    from pp_core.measure.transient import Allocations

    state = sum(t.numel() * t.element_size() for optimizer in optimizers
                for per_param in optimizer.state.values() for t in per_param.values()
                if isinstance(t, torch.Tensor))
    for part in pipe.model_parts:
        part.zero_grad(set_to_none=True)
    log = Allocations()
    dist.barrier()
    with log.tracking():
        pipe.step(x, target=y)
        for optimizer in optimizers:
            optimizer.step()
    return params + state + log.peak()


def _warm_runtime(config_values: dict, x, y) -> None:
    """One step of a tiny model through the same schedule, so that what the process allocates
    once (kernels, thread pools, the communication threads) is in the memory baseline and the
    growth measured afterwards is the model's."""
    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.models.gpt import GPT

    tiny = GPT(vocab_size=16, dim=8, num_layers=16, num_heads=2, max_seq_len=SEQ)
    values = {k: v for k, v in config_values.items() if k != "module_fqns_per_model_part"}
    pipe = build_pipeline(tiny, PipelineConfig(**values))
    pipe.step(x % 16, target=y % 16)


def measure(pool, config_values: dict, steps: int) -> tuple[list[float], list[int], list[int]]:
    """The slowest rank's time of each step, and each rank's measured peak: resident set, and
    live tensors."""
    per_rank = pool.run(run_case, config_values, steps)
    return ([max(step) for step in zip(*(r["times"] for r in per_rank))],
            [r["peak_bytes"] for r in per_rank], [r["live_peak_bytes"] for r in per_rank])


MMAP_THRESHOLD = 65536


def resident_with_pages_returned(pp: int, values: dict, steps: int) -> dict:
    """The resident-set peak of one plan on ranks started with ``MALLOC_MMAP_THRESHOLD_``:
    glibc then maps every allocation over 64 KiB on its own and unmaps it on free, so the
    resident set follows the live tensors instead of keeping freed heap pages (at a cost in
    page faults: ``step_s``)."""
    from pp_core.testing import DistPool

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by each rank at start
    try:
        with DistPool(pp) as pool:
            step_times, peak, _ = measure(pool, values, steps)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    return {"peak": peak, "step_s": statistics.median(step_times)}


def confirm(pool, cases, times, steps: int, rounds: int, top: int = 3) -> dict:
    """Auto and the ``top`` fastest plans by hand measured again, alternating, in fresh runs.

    The best of some twenty plans measured once is biased low by its noise (the winner's
    curse), so the first pass only picks the contenders; this second, independent pass
    compares auto with them."""
    hand = sorted((label for label, _, _ in cases if label.startswith("by hand")),
                  key=lambda label: statistics.median(times[label]))[:top]
    contenders = [case for case in cases if case[0] == cases[0][0] or case[0] in hand]
    out = {label: [] for label, _, _ in contenders}
    for _ in range(2 * rounds):
        for label, values, _ in contenders:
            out[label] += measure(pool, values, steps)[0]
    return out


def by_hand_configs(pp: int, auto_mbs: int, plugins) -> list[tuple[str, dict]]:
    """Every built-in schedule at its default stages per rank, ``layers`` split."""
    out = []
    for entry in plugins.schedules:
        if not entry.plugin.startswith("pp_core_builtins.schedules"):
            continue
        for mbs in sorted({auto_mbs, max(1, BATCH // (2 * pp))}):
            out.append((entry.name, {"pp_schedule": entry.name, "pp_batch_size": BATCH,
                                     "pp_microbatch_size": mbs, "loss_fn": "cross_entropy"}))
    return out


UNCALIBRATED = {"p2p_send_busy_s": 0.0, "p2p_recv_busy_s": 0.0,
                "p2p_busy_bytes_per_s": float("inf"), "action_overhead_s": 0.0}
"""The profile fields as before the calibration (no busy time per send and receive, no executor
time per action): the same run's prediction without it, for the before/after column."""

OWN_PROCESSORS = {"processors": 0.0}
"""A processor per rank, as before the planner knew that ranks share cores."""


def predicted_with(candidate, profiles, pp: int, plugins, fields: dict) -> float:
    """``candidate``'s predicted step, same split, on its profile with ``fields`` replaced."""
    from pp_core.planning.choose import predict
    from pp_core.schedule.build import resolve_schedule_def

    o = candidate.option
    sdef = resolve_schedule_def(o.schedule, plugins)[1]
    return predict(o, sdef, dataclasses.replace(profiles[o.microbatch_size], **fields), pp,
                   candidate.fqns_per_stage).predicted_step_s


def alternatives(candidate, profiles, pp: int, plugins) -> dict:
    """The before/after columns: uncalibrated, and with a processor per rank."""
    return {"predicted_uncalibrated_step_s":
            predicted_with(candidate, profiles, pp, plugins, UNCALIBRATED),
            "predicted_own_processors_step_s":
            predicted_with(candidate, profiles, pp, plugins, OWN_PROCESSORS)}


def predicted_for(values: dict, profiles, pp: int, plugins) -> dict:
    """The planner's prediction for a config as given (its own split, from plan_split)."""
    from pp_core import PipelineConfig, PPCoreError
    from pp_core.planning.choose import Option, predict
    from pp_core.planning.split import plan_split
    from pp_core.schedule.build import resolve_schedule_def

    config = PipelineConfig(**values)
    sdef = resolve_schedule_def(config.pp_schedule, plugins)[1]
    try:
        split = plan_split(make_model(), config, pp, sdef.stages_per_rank, plugins,
                           variable_stages_per_rank=sdef.variable_stages_per_rank)
    except PPCoreError as exc:  # e.g. more stages than blocks: nobody could run it by hand
        return {"dropped": str(exc)}
    option = Option(config.pp_schedule, split.stages_per_rank, config.pp_microbatch_size,
                    config.num_microbatches)
    candidate = predict(option, sdef, profiles[config.pp_microbatch_size], pp,
                        split.fqns_per_stage)
    return {"predicted_step_s": candidate.predicted_step_s, "dropped": candidate.dropped,
            **(alternatives(candidate, profiles, pp, plugins) if not candidate.dropped else {}),
            "predicted_peak_bytes": [m.total(False) for m in candidate.memory]}


def bench_pp(pp: int, steps: int, link, rounds: int) -> dict:
    from pp_core import PipelineConfig
    from pp_core import plan_auto
    from pp_core.planning.choose import choose_plan
    from pp_core.measure.plan_auto import concrete_config
    from pp_core.planning.report import describe, format_ranking
    from pp_core.plugin_manager import default_plugins
    from pp_core.testing import DistPool

    plugins = default_plugins()
    x, y = make_batch()
    torch.set_num_threads(1)
    sizes = sorted({1, 2, 4, BATCH // (2 * pp)})
    base = PipelineConfig(pp_schedule="auto", pp_batch_size=BATCH, loss_fn="cross_entropy")
    plan = plan_auto(make_model(), base, x, y, pp, link=link, microbatch_sizes=sizes,
                     repeats=9)
    ranking, profiles = plan.ranking, plan.profiles
    print(format_ranking(ranking, top=6), flush=True)

    def planned(candidate, label):
        return (label, concrete_config(base, candidate).to_dict(),
                {"predicted_step_s": candidate.predicted_step_s,
                 **alternatives(candidate, profiles, pp, plugins),
                 "predicted_peak_bytes": [m.total(candidate.pool) for m in candidate.memory]})

    cases = [planned(ranking.chosen, f"auto: {describe(ranking.chosen)}")]
    cases += [planned(c, f"planner #{i + 2}: {describe(c)}")
              for i, c in enumerate(ranking.kept[1:3])]
    for name, values in by_hand_configs(pp, ranking.chosen.option.microbatch_size, plugins):
        prediction = predicted_for(values, profiles, pp, plugins)
        if not prediction.get("dropped"):
            cases.append((f"by hand: {name}, mbs {values['pp_microbatch_size']}, layers split",
                          values, prediction))
    cap = int(ranking.chosen.peak_bytes * 0.97)
    capped = choose_plan(profiles, pp, BATCH, memory_cap=cap)
    cases.append(planned(capped.chosen, f"auto, cap {cap / 2 ** 20:.1f} MiB: "
                                        f"{describe(capped.chosen)}"))
    times = {label: [] for label, _, _ in cases}
    peaks = {label: [] for label, _, _ in cases}
    lives = {label: [] for label, _, _ in cases}
    with DistPool(pp) as pool:
        measure(pool, cases[0][1], 1)  # the pool's first case pays for its start
        for _ in range(rounds):  # interleaved: a burst of load from elsewhere hits all alike
            for label, values, _ in cases:
                step_times, peak, live = measure(pool, values, steps)
                times[label] += step_times
                peaks[label].append(peak)
                lives[label].append(live)
        confirmed = confirm(pool, cases, times, steps, rounds)
    returned = resident_with_pages_returned(pp, cases[-1][1], steps)
    rows = []
    for label, values, prediction in cases:
        row = {"label": label, **prediction, "measured_step_s": statistics.median(times[label]),
               "measured_min_step_s": min(times[label]),
               "measured_peak_bytes": [max(p) for p in zip(*peaks[label])],
               "live_peak_bytes": [max(p) for p in zip(*lives[label])]}
        row["error"] = row["measured_step_s"] / row["predicted_step_s"] - 1
        row["error_min"] = row["measured_min_step_s"] / row["predicted_step_s"] - 1
        row["error_uncalibrated"] = \
            row["measured_step_s"] / row["predicted_uncalibrated_step_s"] - 1
        row["error_own_processors"] = \
            row["measured_step_s"] / row["predicted_own_processors_step_s"] - 1
        rows.append(row)
        print(f"  pp={pp} {label}: predicted {row['predicted_step_s'] * 1e3:.1f} ms "
              f"({row['predicted_uncalibrated_step_s'] * 1e3:.1f} uncalibrated), measured "
              f"{row['measured_step_s'] * 1e3:.1f} ms median ({100 * row['error']:+.0f}%), "
              f"{row['measured_min_step_s'] * 1e3:.1f} ms min", flush=True)
    auto, under_cap = rows[0], rows[-1]
    confirmed_best = min((label for label in confirmed if label != cases[0][0]),
                         key=lambda label: statistics.median(confirmed[label]))
    hand = [r for r in rows if r["label"].startswith("by hand")]
    best_hand = min(hand, key=lambda r: r["measured_step_s"])
    best_hand_min = min(hand, key=lambda r: r["measured_min_step_s"])
    return {
        "pp": pp, "link": list(dataclasses.astuple(link)), "processors": plan.processors, "profile_s": plan.profile_s,
        "runs": rows,
        "auto_over_best_by_hand": auto["measured_step_s"] / best_hand["measured_step_s"],
        "best_by_hand": best_hand["label"],
        "confirmation": {"steps": {label: statistics.median(t) for label, t in confirmed.items()},
                         "best_by_hand": confirmed_best,
                         "auto_over_best_by_hand": statistics.median(confirmed[cases[0][0]])
                         / statistics.median(confirmed[confirmed_best])},
        "auto_over_best_by_hand_min": auto["measured_min_step_s"]
        / best_hand_min["measured_min_step_s"], "best_by_hand_min": best_hand_min["label"],
        "memory_cap": {"cap_bytes": cap, "chosen": under_cap["label"],
                       "predicted_peak_bytes": under_cap["predicted_peak_bytes"],
                       "measured_peak_bytes": under_cap["measured_peak_bytes"],
                       "live_peak_bytes": under_cap["live_peak_bytes"],
                       "fits_measured": max(under_cap["measured_peak_bytes"]) <= cap,
                       "fits_live": max(under_cap["live_peak_bytes"]) <= cap,
                       "resident_pages_returned_bytes": returned["peak"],
                       "pages_returned_step_s": returned["step_s"],
                       "fits_resident_pages_returned": max(returned["peak"]) <= cap,
                       "gave_up": [{"plan": describe(c), "predicted_step_s": c.predicted_step_s,
                                    "why": c.dropped} for c in capped.gave_up()[:3]]},
    }


def planning_time_pp8() -> dict:
    """choose_plan at pp=8 with every installed schedule, on a profile of a 30-block model;
    with a processor per rank and with the ranks sharing 2 (the processor-sharing replay)."""
    from pp_core.losses import resolve_loss
    from pp_core.planning.choose import choose_plan
    from pp_core.measure.profile import profile_model
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=32, num_layers=30, num_heads=2, max_seq_len=16)
    x = torch.randint(0, 256, (64, 16))
    profiles = profile_model(model, x, x, resolve_loss("cross_entropy"), [1, 2, 4, 8], "cpu",
                             repeats=1, p2p=(1e-4, 1e9))
    started = time.perf_counter()
    ranking = choose_plan(profiles, 8, 64)
    seconds = time.perf_counter() - started
    shared = {size: dataclasses.replace(p, processors=2.0) for size, p in profiles.items()}
    started = time.perf_counter()
    choose_plan(shared, 8, 64)  # as for 8 one-thread ranks on this 2-core machine
    return {"pp": 8, "units": len(profiles[1].units), "pp_batch_size": 64,
            "candidates": len(ranking.kept) + len(ranking.dropped), "kept": len(ranking.kept),
            "planning_s": seconds, "planning_shared_2_processors_s":
            time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over all cases")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--world", type=int, metavar="N",
                        help="instead: the whole-layout planner at N processes "
                             "(benchmarks/bench_planner_layouts.py)")
    args = parser.parse_args(argv)
    if args.world is not None:
        from bench_planner_layouts import bench_layouts, table as layouts_table

        report = bench_layouts(args.world)
        print(layouts_table(report))
        write_json(args.json, report)
        return 0
    from pp_core.measure.link import measure_local_link

    load = os.getloadavg()
    link = measure_local_link("gloo", "cpu")
    figures = list(dataclasses.astuple(link))  # the report's link: the figures in field order
    report = {"model": MODEL, "batch": BATCH, "seq_len": SEQ, "link": figures,
              "load_before": load, "planning_pp8": planning_time_pp8(), "pp": []}
    print(f"planning at pp=8: {report['planning_pp8']}", flush=True)
    for pp in (int(r) for r in args.ranks.split(",")):
        report["pp"].append(bench_pp(pp, args.steps, link, args.rounds))
    report["load_after"] = os.getloadavg()
    print(table(report))
    write_json(args.json, report)
    return 0


def table(report: dict) -> str:
    lines = ["| pp | plan | predicted ms | measured ms (median) | error | measured ms (min) | "
             "error (min) | predicted ms uncalibrated | its error | predicted ms, a processor "
             "per rank | its error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in report["pp"]:
        for row in entry["runs"]:
            lines.append(f"| {entry['pp']} | {row['label']} | {row['predicted_step_s'] * 1e3:.1f} "
                         f"| {row['measured_step_s'] * 1e3:.1f} | {100 * row['error']:+.0f}% "
                         f"| {row['measured_min_step_s'] * 1e3:.1f} "
                         f"| {100 * row['error_min']:+.0f}% "
                         f"| {row['predicted_uncalibrated_step_s'] * 1e3:.1f} "
                         f"| {100 * row['error_uncalibrated']:+.0f}% "
                         f"| {row['predicted_own_processors_step_s'] * 1e3:.1f} "
                         f"| {100 * row['error_own_processors']:+.0f}% |")
    for entry in report["pp"]:
        cap = entry["memory_cap"]
        again = entry["confirmation"]
        lines.append(f"\npp={entry['pp']}: measured again, alternating: auto / best by hand "
                     f"({again['best_by_hand']}) = {again['auto_over_best_by_hand']:.3f}")
        lines.append(f"pp={entry['pp']}: auto / best by hand ({entry['best_by_hand']}) = "
                     f"{entry['auto_over_best_by_hand']:.3f} (median), "
                     f"{entry['auto_over_best_by_hand_min']:.3f} (min, best by hand "
                     f"{entry['best_by_hand_min']}); cap {cap['cap_bytes'] / 2 ** 20:.1f}"
                     f" MiB -> {cap['chosen']}, measured peak per rank "
                     + ", ".join(f"{b / 2 ** 20:.1f}" for b in cap["measured_peak_bytes"])
                     + f" MiB (fits: {cap['fits_measured']}), predicted "
                     + ", ".join(f"{b / 2 ** 20:.1f}" for b in cap["predicted_peak_bytes"])
                     + ", live tensors " + ", ".join(f"{b / 2 ** 20:.1f}"
                                                     for b in cap["live_peak_bytes"])
                     + f" MiB (fits: {cap['fits_live']}); resident set with "
                     f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} "
                     + ", ".join(f"{b / 2 ** 20:.1f}" for b in cap["resident_pages_returned_bytes"])
                     + f" MiB (fits: {cap['fits_resident_pages_returned']})")
    p8 = report["planning_pp8"]
    lines.append(f"\nplanning at pp=8: {p8['candidates']} candidates in {p8['planning_s']:.2f} s"
                 f" ({p8['planning_shared_2_processors_s']:.2f} s sharing 2 processors)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
