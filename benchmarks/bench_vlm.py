"""Where a vision-language model's encoder goes: the anchors' stage 0 against a split by cost.

Model: a LLaVA (CLIP tower, Llama decoder) made here with random weights, its vision tower sized
to cost about two and a half of its six decoder layers (the profile says how much: printed and
saved); every sample holds one 32 x 32 image (64 placeholder tokens) in 128 tokens. pp 2, 1F1B,
16 samples in 8 microbatches of 2, gloo, one thread per rank. Three placements, each built on
the same weights and run alternately (which goes first alternates too):

* **stage 0** - what torchtitan's ``pipeline_with_first_stage_modules`` and NeMo AutoModel do,
  and ``hf_vision_language``'s split without a cost: the whole encoder with the embedding and the
  first half of the decoder layers on stage 0, the other half (and the head) on stage 1;
* **by cost** - the ``balanced`` splitter's cut of the same units by the profiled forward +
  backward time (``model.splitter: balanced``), same schedule;
* **auto** - ``pp_schedule: auto``'s choice (schedule and split; the microbatch size held at 2,
  so 8 microbatches as the others).

``profile_model`` runs once, in this process, before the ranks start, as ``pp-core run`` does.
Reported per placement: blocks per stage, the planner's predicted step time and bubble (its
simulator on the profile and the measured link) beside the measured ones - the median over the
timed steps of the slowest rank's ``Pipeline.step``, and each rank's bubble (1 - its compute
actions' time / its step, from the step's action trace) - and the median CPU time of the busiest
rank per step (the work a placement leaves on it: a wait, for a peer or for a core, costs none).

    python benchmarks/bench_vlm.py [--steps 8] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time

import torch
from _common import write_json

SAMPLES, MICROBATCH, TEXT, IMAGE_TOKENS = 16, 2, 64, 64
IMAGE_TOKEN = 1000
COMPUTE = re.compile(r"\d+[FBIW]\d+")
CONFIG = {
    "model_type": "llava", "image_token_id": IMAGE_TOKEN, "vision_feature_layer": -1,
    "text_config": {"model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
                    "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "max_position_embeddings": 256},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 256,
                      "intermediate_size": 1024, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "image_size": 32, "patch_size": 4},
}


def make_model():
    from pp_core_builtins.transformers import hf_image_text_to_text

    return hf_image_text_to_text(CONFIG, seed=0, attn_implementation="sdpa")


def make_batch():
    """16 samples, each: 32 text tokens, the image's 64 placeholders, 32 text tokens."""
    generator = torch.Generator().manual_seed(1)
    half = torch.randint(3, IMAGE_TOKEN, (SAMPLES, TEXT // 2), generator=generator)
    ids = torch.cat([half, torch.full((SAMPLES, IMAGE_TOKENS), IMAGE_TOKEN), half.flip(1)], 1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "pixel_values": torch.randn(SAMPLES, 3, 32, 32, generator=generator)}
    return inputs, ids.masked_fill(ids == IMAGE_TOKEN, -100)


def config(schedule="1f1b", fqns=None):
    from pp_core import PipelineConfig

    return PipelineConfig(pp_schedule=schedule, pp_batch_size=SAMPLES,
                          pp_microbatch_size=MICROBATCH, module_fqns_per_model_part=fqns,
                          loss_fn="pp_core_builtins.transformers:causal_lm_loss")


def unit_stages(model, fqns_per_stage) -> list[list[str]]:
    """A split as lists of the units' names (what the planner predicts from)."""
    from pp_core_builtins.transformers.vision_layout import find_vision_layout, held_units

    layout = find_vision_layout(model)
    units = layout.units()
    return [[f for i in held_units(layout, fqns, f"stage {s}") for f in units[i]]
            for s, fqns in enumerate(fqns_per_stage)]


def run_case(values: dict, steps: int, warmup: int = 2) -> dict:
    """On every rank: step times, CPU times and bubbles of one placement."""
    import torch.distributed as dist

    from pp_core import PipelineConfig, build_pipeline

    inputs, labels = make_batch()
    pipe = build_pipeline(make_model(), PipelineConfig(**values))
    optimizers = [torch.optim.SGD(part.parameters(), lr=1e-3) for part in pipe.model_parts]
    times, cpu, bubbles = [], [], []
    for step in range(warmup + steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        pipe.tracing = step >= warmup
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        pipe.step(inputs, target=labels)
        elapsed, used = time.perf_counter() - t0, time.process_time() - c0
        for optimizer in optimizers:
            optimizer.step()
        if step >= warmup:
            busy = sum(end - start for action, start, end in pipe.last_trace
                       if COMPUTE.fullmatch(action))  # "0F3": stage, kind, microbatch
            times.append(elapsed)
            cpu.append(used)
            bubbles.append(1 - busy / elapsed)
    return {"times": times, "cpu": cpu, "bubbles": bubbles, "stages": list(pipe.stage_indices)}


def predicted(profile, link, values: dict, fqns, plugins) -> dict:
    from pp_core.planning.choose import Option, predict
    from pp_core.schedule.build import resolve_schedule_def

    sdef = resolve_schedule_def(values["pp_schedule"], plugins)[1]
    option = Option(values["pp_schedule"], len(fqns) // 2, MICROBATCH, SAMPLES // MICROBATCH)
    candidate = predict(option, sdef, dataclasses.replace(profile, **link.profile_fields()), 2,
                        fqns)
    return {"predicted_step_s": candidate.predicted_step_s,
            "predicted_bubble": candidate.bubble_ratio}


def blocks(fqns_per_stage) -> list[str]:
    """Per stage, what it holds: vision blocks (v) and decoder layers (d)."""
    return [f"{sum('.encoder.layers.' in f for f in stage)}v + "
            f"{sum('language_model.layers.' in f for f in stage)}d" for stage in fqns_per_stage]


def bench(steps: int, rounds: int) -> dict:
    from pp_core import plan_auto
    from pp_core.measure.link import measure_local_link
    from pp_core.measure.plan_auto import concrete_config
    from pp_core.planning.balance import split_by_profile
    from pp_core.planning.split import plan_split
    from pp_core.plugin_manager import default_plugins
    from pp_core.testing import DistPool

    torch.set_num_threads(1)
    plugins = default_plugins()
    model = make_model()
    inputs, labels = make_batch()
    link = measure_local_link("gloo", "cpu")
    plan = plan_auto(model, config("auto"), inputs, labels, 2, link=link,
                     microbatch_sizes=[MICROBATCH], repeats=9)
    profile = plan.profiles[MICROBATCH]
    costs = [(u.fqns[0], (u.forward_s + u.backward_s) * 1e3) for u in profile.units]
    vision = sum(c for name, c in costs if "vision_tower" in name or "projector" in name)
    layers = [c for name, c in costs if "language_model.layers." in name]
    anchors = unit_stages(model, plan_split(model, config(), 2, 1, plugins).fqns_per_stage)
    by_cost = split_by_profile(profile, 2)
    auto = concrete_config(config("auto"), plan.ranking.chosen).to_dict()
    cases = [("stage 0 (anchors)", config(fqns=anchors).to_dict(), anchors),
             ("by cost (balanced)", config(fqns=by_cost).to_dict(), by_cost),
             (f"auto ({auto['pp_schedule']})", auto,
              unit_stages(model, auto["module_fqns_per_model_part"]))]
    measured = {label: {"times": [], "cpu": [], "bubbles": [[], []]} for label, _, _ in cases}
    with DistPool(2, timeout=1800) as pool:
        for round_ in range(rounds):
            order = cases if round_ % 2 == 0 else cases[::-1]
            for label, values, _ in order:
                per_rank = pool.run(run_case, values, steps)
                by_stage = sorted(per_rank, key=lambda r: r["stages"][0])
                measured[label]["times"] += [max(t) for t in zip(*(r["times"] for r in per_rank))]
                measured[label]["cpu"] += [max(c) for c in zip(*(r["cpu"] for r in per_rank))]
                for rank, result in enumerate(by_stage):
                    measured[label]["bubbles"][rank] += result["bubbles"]
    rows = []
    for label, values, fqns in cases:
        got = measured[label]
        row = {"label": label, "stages": blocks(fqns), "schedule": values["pp_schedule"],
               **predicted(profile, link, values, fqns, plugins),
               "measured_step_s": statistics.median(got["times"]),
               "busiest_cpu_s": statistics.median(got["cpu"]),
               "measured_bubble": [statistics.median(b) for b in got["bubbles"]],
               "fqns_per_stage": fqns}
        row["error"] = row["measured_step_s"] / row["predicted_step_s"] - 1
        rows.append(row)
    base = rows[0]["measured_step_s"]
    for row in rows:
        row["over_stage0"] = row["measured_step_s"] / base
    return {"config": CONFIG, "samples": SAMPLES, "microbatch": MICROBATCH,
            "link": list(dataclasses.astuple(link)),
            "unit_costs_ms": costs, "vision_ms": vision,
            "decoder_layer_ms": statistics.mean(layers), "runs": rows}


def table(report: dict) -> str:
    lines = [f"vision tower + projector F+B {report['vision_ms']:.2f} ms per microbatch = "
             f"{report['vision_ms'] / report['decoder_layer_ms']:.2f} decoder layers "
             f"({report['decoder_layer_ms']:.2f} ms each)", "",
             "| placement | schedule | stages (vision blocks v, decoder layers d) | predicted "
             "step ms | measured step ms | error | x stage 0 | predicted bubble | measured "
             "bubble (rank 0, 1) | busiest-rank CPU ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        lines.append(
            f"| {row['label']} | {row['schedule']} | {' / '.join(row['stages'])} "
            f"| {row['predicted_step_s'] * 1e3:.1f} | {row['measured_step_s'] * 1e3:.1f} "
            f"| {100 * row['error']:+.0f}% | **{row['over_stage0']:.2f}** "
            f"| {100 * row['predicted_bubble']:.0f}% "
            f"| {', '.join(f'{100 * b:.0f}%' for b in row['measured_bubble'])} "
            f"| {row['busiest_cpu_s'] * 1e3:.1f} |")
    lines.append(f"\nload average {report['load_before']} -> {report['load_after']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating passes over the cases")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    report = bench(args.steps, args.rounds)
    report["load_before"], report["load_after"] = load, os.getloadavg()
    print(table(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
