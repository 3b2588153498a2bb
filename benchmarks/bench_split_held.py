"""Predicted peak memory per rank against the live tensors measured, for split-backward plans.

A split backward's ``I`` keeps gradients alive until its ``W`` (the boundary gradients ``W``
restarts from, :mod:`pp_core.measure.held_for_weight`). This runs the bench_planner GPT
(embedding and head heavier than a block) on gloo ranks of this machine with split-backward
schedules and a whole-backward control, each with the ``layers`` split, and prints per rank the
planner's prediction (``predict_memory``, no receive-buffer pool) next to the live-tensor peak
of one ``Pipeline.step`` + AdamW step (``bench_planner.live_peak``: parameters + optimizer
state + the allocation log's peak). ``--profile-out`` stores the profile, so the prediction of
another checkout can be made from the same measurement (``--profile-in``, ``--predict-only``).

    python benchmarks/bench_split_held.py [--ranks 2] [--mbs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_planner import BATCH, make_batch, make_model, predicted_for, run_case  # noqa: E402

SCHEDULES = ("zero_bubble", "v_schedule", "dualpipe_v", "1f1b")


def profile(mbs: int):
    from pp_core.losses import resolve_loss
    from pp_core.measure.profile import profile_model

    x, y = make_batch()
    return profile_model(make_model(), x, y, resolve_loss("cross_entropy"), [mbs], repeats=1)[mbs]


def load_profile(path: str):
    """A stored profile; keys this checkout's ``UnitCost`` does not know are dropped (so an
    older checkout predicts from the same measurement)."""
    from dataclasses import fields

    from pp_core.planning.costs import ModelProfile, UnitCost

    data = json.load(open(path, encoding="utf-8"))
    known = {f.name for f in fields(UnitCost)}
    data["units"] = [{k: v for k, v in unit.items() if k in known} for unit in data["units"]]
    return ModelProfile.from_dict(data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--profile-in")
    parser.add_argument("--profile-out")
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    from pp_core.plugin_manager import default_plugins
    from pp_core.testing import DistPool

    torch.set_num_threads(1)
    plugins = default_plugins()
    measured = load_profile(args.profile_in) if args.profile_in else profile(args.mbs)
    if args.profile_out:
        json.dump(measured.to_dict(), open(args.profile_out, "w", encoding="utf-8"))
    rows = []
    for name in args.schedules.split(","):
        values = {"pp_schedule": name, "pp_batch_size": BATCH, "pp_microbatch_size": args.mbs,
                  "loss_fn": "cross_entropy"}
        predicted = predicted_for(values, {args.mbs: measured}, args.ranks, plugins)
        rows.append({"schedule": name, "values": values,
                     "predicted_peak_bytes": predicted.get("predicted_peak_bytes"),
                     "dropped": predicted.get("dropped")})
    if not args.predict_only:
        with DistPool(args.ranks) as pool:
            for row in rows:
                if not row["dropped"]:
                    per_rank = pool.run(run_case, row["values"], 1, 1)
                    row["live_peak_bytes"] = [r["live_peak_bytes"] for r in per_rank]
    load = os.getloadavg()
    print(f"pp={args.ranks}, microbatch size {args.mbs}, {BATCH // args.mbs} microbatches, "
          f"load {load[0]:.1f}")
    print("| schedule | predicted MiB per rank | live MiB per rank | live / predicted |")
    print("|---|---|---|---|")
    for row in rows:
        pred, live = row["predicted_peak_bytes"], row.get("live_peak_bytes")
        if row["dropped"]:
            print(f"| {row['schedule']} | dropped: {row['dropped']} | | |")
            continue
        mib = lambda values: " ".join(f"{v / 2 ** 20:.2f}" for v in values)  # noqa: E731
        ratio = " ".join(f"{m / p:.3f}" for m, p in zip(live, pred)) if live else "-"
        print(f"| {row['schedule']} | {mib(pred)} | {mib(live) if live else '-'} | {ratio} |")
    if args.json:
        json.dump({"ranks": args.ranks, "mbs": args.mbs, "load": load, "rows": rows},
                  open(args.json, "w", encoding="utf-8"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
