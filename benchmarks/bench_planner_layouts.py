"""The whole-layout planner (``pp-core plan --world N``) against runs of the layouts it ranks.

``python benchmarks/bench_planner.py --world 4`` runs this part (or this file directly). On
this machine's cores, one thread per rank, gloo:

* **prediction**: ``plan_world`` ranks every layout of 4 processes of a GPT; the best plan of
  pp 4, pp 2 x dp 2, pp 2 x tp 2, pp 1 x dp 2 x tp 2 and the chosen layout are written
  (``-o``'s YAML) and run through ``pp-core run``; measured step = median ``step_time_s`` of
  the timed steps (rank 0's whole step, optimizer included) against the predicted; the same
  for moe_gpt at pp 2 x dp 2 x ep 2 and pp 1 x dp 4 x ep 2; the report keeps what the plan
  measured besides the profile (the pipeline factor, the data-parallel engine's costs, the
  layout it ran per tp / ep degree pair: a row of a layout the plan ran is marked
  ``timed_by_the_plan`` - a check of run-to-run spread, not of a prediction; the other layouts
  at its degrees are);
* **auto vs by hand**: the chosen plan against each of those layouts written by hand (1f1b,
  the even ``layers`` split, no activation checkpointing, 2 x pp microbatches), measured;
* **where memory binds** (``--capped``, run this file directly): a cap of 3/4 of the uncapped
  choice's predicted peak, AC ``auto``; the chosen plan against the layouts by hand with every
  stage recomputing;
* **the machine's speed**: this VM's processors are shared with others by its hypervisor, and
  the share it loses (steal time, ``/proc/stat``) moves between minutes - 1 % one hour, 45 %
  the next - which no prediction made before the run can follow. The share stolen is read
  while the plan measures and during every run; each row keeps the drift ((1 - stolen at the
  plan) / (1 - stolen at the run)) and the error at the plan's speed (the prediction scaled
  by the drift), beside the plain error - which is what a user sees;
* **planning time** at world 8 and 64: the search over every layout with the costs measured
  for world 4 (no run; layouts at a tp degree not profiled reuse the largest profiled one's
  profile, which changes nothing of the search's work).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

MODEL = {"vocab_size": 512, "dim": 128, "num_layers": 4, "num_heads": 4, "max_seq_len": 64}
MOE_ARGS = {"num_experts": 4, "top_k": 2}
BASE = {
    "model": {"name": "gpt", "args": MODEL},
    "data": {"name": "synthetic", "args": {"seq_len": 64, "vocab_size": 512}},
    "pipeline": {"pp_schedule": "auto", "pp_batch_size": 16, "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2, "device": "cpu"},
    "train": {"steps": 8, "log_every": 1, "optimizer": {"name": "AdamW", "lr": 1e-3}},
    "output": {"progress": "off", "summary": False},
}
TIMED_FROM = 3  # steps before it warm up


def spec_of(values: dict, tmp: str, name: str):
    from pp_core.app.spec import load_spec

    path = os.path.join(tmp, name)
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    return load_spec(path)


def run_yaml(values: dict, tmp: str, name: str) -> float:
    """Run ``values`` through ``pp-core run``; the median step time of the timed steps."""
    path, metrics = os.path.join(tmp, name + ".yaml"), os.path.join(tmp, name + ".jsonl")
    values = json.loads(json.dumps(values))
    values["train"].update(steps=BASE["train"]["steps"], log_every=1)
    values["output"] = {**values.get("output", {}), "metrics": metrics, "progress": "off",
                        "summary": False}
    values.get("checkpoint", {}).pop("dir", None)
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh)
    subprocess.run([sys.executable, "-m", "pp_core", "run", path], check=True,
                   stdout=subprocess.DEVNULL)
    with open(metrics) as fh:
        rows = [json.loads(line) for line in fh if '"step_time_s"' in line]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] >= TIMED_FROM)


def cpu_ticks() -> tuple[int, int]:
    """``(stolen, total)`` CPU ticks of the machine so far (``/proc/stat``): the time the
    hypervisor gave the VM's processors to others, out of all; ``(0, 0)`` where unreadable."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def stolen_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's processor time stolen between two :func:`cpu_ticks`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def planned(spec, world: int, **options):
    """``plan_world``, and the share of the processors stolen while it measured."""
    from pp_core.app.plan.plan_world import plan_world

    before = cpu_ticks()
    found = plan_world(spec, world, **options)
    found.stolen = stolen_share(before, cpu_ticks())
    return found


def find(world_plan, pp, dp_replicate, tp, ep=1):
    for lp in world_plan.layouts:
        d = lp.dims
        if (d.pp, d.dp_replicate, d.dp_shard, d.tp, d.ep) == (pp, dp_replicate, 1, tp, ep):
            return lp
    return None


def measured_layouts(spec, world_plan, tmp: str, targets, tag: str,
                     rounds: int = 1) -> list[dict]:
    """Each target's plan run ``rounds`` times, the layouts in turn (A B C A B C: a drift of
    the machine's speed then shows as the spread of each layout's rounds); the median counts."""
    from pp_core.app.launch.decide import written_spec
    from pp_core.planning.report import ac_letters, describe

    chosen, seen = [], set()
    for label, dims in targets:
        lp = find(world_plan, *dims) if dims else world_plan.chosen_layout
        if lp is not None and lp.dims not in seen:
            seen.add(lp.dims)
            chosen.append((label, lp))
    measured = [[] for _ in chosen]
    stolen = [[] for _ in chosen]
    for _ in range(rounds):
        for index, (_, lp) in enumerate(chosen):
            before = cpu_ticks()
            measured[index].append(run_yaml(written_spec(lp.spec, lp.plan), tmp,
                                            f"{tag}-{index}"))
            stolen[index].append(stolen_share(before, cpu_ticks()))
    timed = {t.dims for t in world_plan.timed.values()}
    rows = []
    for (label, lp), times, lost in zip(chosen, measured, stolen):
        predicted, median = lp.best.predicted_step_s, statistics.median(times)
        # what the processors gave at the run, against what they gave while the plan measured
        drift = (1 - world_plan.stolen) / (1 - statistics.median(lost))
        rows.append({"label": label, "layout": lp.dims.describe(), "plan": describe(lp.best),
                     "ac": ac_letters(lp.best), "predicted_step_s": predicted,
                     "measured_step_s": median, "rounds_s": times,
                     "error": predicted / median - 1, "stolen": lost, "drift": drift,
                     # the plan ran this layout to time its tp / ep degrees: not a prediction
                     "timed_by_the_plan": lp.dims in timed,
                     "error_at_plan_speed": predicted * drift / median - 1})
        print(rows[-1], flush=True)
    return rows


def by_hand(spec, dims_list, tmp: str, ac: str = "none") -> list[dict]:
    from pp_core.app.plan.plan_world import layout_spec
    from pp_core.parallel.dims import ParallelDims

    rows = []
    for pp, dp, tp in dims_list:
        placed = layout_spec(spec, ParallelDims(pp, dp, 1, tp)).to_dict()
        placed.pop("plan", None)
        batch = placed["pipeline"]["pp_batch_size"]
        placed["pipeline"].update(pp_schedule="1f1b", pp_microbatch_size=max(1, batch // (2 * pp)))
        placed["distributed"].pop("dp_size", None)
        placed["train"]["activation_checkpointing"] = {"mode": ac, "every": 1}
        measured = run_yaml(placed, tmp, f"hand-{pp}-{dp}-{tp}-{ac}")
        rows.append({"label": f"by hand: 1f1b, even split, AC {ac}, pp {pp} x dp {dp} x "
                              f"tp {tp}", "measured_step_s": measured})
        print(rows[-1], flush=True)
    return rows


def bench_capped(world: int, tmp: str, share: float = 0.75) -> dict:
    """Where memory binds: a cap of ``share`` x the uncapped choice's predicted peak; the
    plan ``--world`` chooses under it (activation checkpointing ``auto``: per stage) against
    each layout written by hand with every stage recomputing (``full``: the uniform setting
    a user picks to fit), the even split, 1f1b, 2 x pp microbatches."""
    from pp_core.app.plan.plan_world import plan_world

    values = json.loads(json.dumps(BASE))
    values["train"]["activation_checkpointing"] = {"mode": "auto"}
    spec = spec_of(values, tmp, "capped.yaml")
    free = plan_world(spec, world)
    cap = int(share * free.chosen.peak_bytes)
    capped = planned(spec, world, memory_cap=cap)
    report = {"memory_cap": cap, "uncapped_peak": free.chosen.peak_bytes,
              "runs": measured_layouts(spec, capped, tmp, [("chosen under the cap", None)],
                                       "capped"),
              "by_hand": by_hand(spec, [(4, 1, 1), (2, 2, 1), (2, 1, 2)], tmp, ac="full")}
    chosen = capped.chosen
    report["runs"][0].update(peak_bytes=chosen.peak_bytes,
                             memory_per_rank=[m.total(chosen.pool) for m in chosen.memory])
    best = min(report["by_hand"], key=lambda r: r["measured_step_s"])
    report["auto_over_best_by_hand"] = report["runs"][0]["measured_step_s"] / \
        best["measured_step_s"]
    report["best_by_hand"] = best["label"]
    return report


def planning_time(world_plan, spec, world: int) -> dict:
    """The search alone over every layout of ``world`` with world 4's measured costs."""
    from pp_core.app.plan.plan_world import model_shape, meta_model, plan_layout
    from pp_core.measure.layouts import enumerate_layouts

    big = spec.with_("pipeline", pp_batch_size=world * 2)
    started = time.perf_counter()
    admitted, _ = enumerate_layouts(world, model_shape(big, meta_model(big)))
    profiled = sorted(world_plan.profiles)
    for dims in admitted:
        profiles = world_plan.profiles[max(t for t in profiled if t <= dims.tp)]
        plan_layout(big, dims, world, profiles, None, world_plan.link, world_plan.collectives,
                    world_plan.experts)
    return {"world": world, "layouts": len(admitted),
            "planning_s": time.perf_counter() - started}


def bench_layouts(world: int = 4, rounds: int = 1) -> dict:
    report = {"torch": __import__("torch").__version__, "load_before": os.getloadavg(),
              "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
        spec = spec_of(BASE, tmp, "gpt.yaml")
        found = planned(spec, world)
        report["stolen_at_plan"] = found.stolen
        report["profile_s"], report["search_s"] = found.profile_s, found.planning_s
        report["pipeline_factor"] = found.pipeline_factor
        report["collectives"] = found.collectives.to_dict()
        report["engine"] = report["collectives"]["engine"]
        report["timed_layouts"] = found.to_dict()["timed_layouts"]
        report["ranked"] = [{"layout": lp.dims.describe(), "dp_shard": lp.dims.dp_shard,
                             "predicted_step_s": lp.best.predicted_step_s}
                            for lp in found.layouts]
        report["runs"] = measured_layouts(spec, found, tmp, [
            ("chosen", None), ("pp 4", (4, 1, 1)), ("pp 2 x dp 2", (2, 2, 1)),
            ("pp 2 x tp 2", (2, 1, 2)), ("pp 1 x dp 2 x tp 2", (1, 2, 2))], "gpt", rounds)
        report["by_hand"] = by_hand(spec, [(4, 1, 1), (2, 2, 1), (2, 1, 2)], tmp)
        auto = report["runs"][0]["measured_step_s"]
        best = min(report["by_hand"], key=lambda r: r["measured_step_s"])
        report["auto_over_best_by_hand"] = auto / best["measured_step_s"]
        report["best_by_hand"] = best["label"]
        report["planning"] = [planning_time(found, spec, w) for w in (8, 64)]
        moe_values = json.loads(json.dumps(BASE))
        moe_values["model"] = {"name": "moe_gpt", "args": {**MODEL, **MOE_ARGS}}
        moe_spec = spec_of(moe_values, tmp, "moe.yaml")
        moe = planned(moe_spec, world)
        report["moe_stolen_at_plan"] = moe.stolen
        report["moe_pipeline_factor"] = moe.pipeline_factor
        report["moe_timed_layouts"] = moe.to_dict()["timed_layouts"]
        report["moe_ranked"] = [{"layout": lp.dims.describe(),
                                 "predicted_step_s": lp.best.predicted_step_s}
                                for lp in moe.layouts]
        report["moe_runs"] = measured_layouts(moe_spec, moe, tmp, [
            ("moe pp 2 x dp 2 x ep 2", (2, 2, 1, 2)), ("moe pp 1 x dp 4 x ep 2", (1, 4, 1, 2)),
            ("moe chosen", None)], "moe", rounds)
    report["load_after"] = os.getloadavg()
    return report


def table(report: dict) -> str:
    lines = ["| layout | plan | AC | predicted ms | measured ms | error | drift | error at the "
             "plan's speed |", "|---|---|---|---|---|---|---|---|"]
    for row in report["runs"] + report["moe_runs"]:
        label = row["label"] + (" (timed by the plan)" if row["timed_by_the_plan"] else "")
        lines.append(f"| {label}: {row['layout']} | {row['plan']} | {row['ac']} "
                     f"| {row['predicted_step_s'] * 1e3:.1f} | {row['measured_step_s'] * 1e3:.1f} "
                     f"| {100 * row['error']:+.0f}% | {row['drift']:.2f} "
                     f"| {100 * row['error_at_plan_speed']:+.0f}% |")
    for row in report["by_hand"]:
        lines.append(f"| {row['label']} | | | | {row['measured_step_s'] * 1e3:.1f} | | | |")
    lines.append(f"\nauto (chosen layout) / best by hand ({report['best_by_hand']}) = "
                 f"{report['auto_over_best_by_hand']:.3f}")
    for p in report["planning"]:
        lines.append(f"planning at world {p['world']}: {p['layouts']} layouts searched in "
                     f"{p['planning_s']:.2f} s")
    lines.append(f"pipeline factor {report['pipeline_factor']:.2f} (moe_gpt "
                 f"{report['moe_pipeline_factor']:.2f}); engine {report['engine']}")
    for key in ("timed_layouts", "moe_timed_layouts"):
        lines.append(f"{key}: " + "; ".join(
            f"{t['layout']} ran {t['measured_step_s'] * 1e3:.1f} ms, {t['factor']:.2f}x its "
            f"arithmetic" for t in report[key]))
    lines.append(f"torch {report['torch']}, {report['cores']} cores, load "
                 f"{report['load_before']} -> {report['load_after']}")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["--capped"]:
    with tempfile.TemporaryDirectory(prefix="bench-capped-") as scratch:
        result = bench_capped(4, scratch)
    print(json.dumps(result, indent=1))
elif __name__ == "__main__":  # [--rounds N]: each layout's run N times, in turn
    result = bench_layouts(rounds=int(sys.argv[2]) if sys.argv[1:2] == ["--rounds"] else 1)
    print(json.dumps(result, indent=1))
    print(table(result))
