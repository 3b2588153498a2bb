"""Sequence slices (``pp_seq_chunks``): step time, bubble and saved bytes at pp 4, K = 1, 2, 4, 8.

Model: the demo GPT (dim ``--dim``, 8 blocks, 4 heads), rows of ``--seq`` tokens, 8 microbatches
of 1 row, 1F1B on 4 gloo ranks (CPU, one thread each; the pool of ``pp_core.testing``). For each
K the same weights train ``--steps`` steps; reported per K: the median step time, the measured
``peak_saved_bytes`` of every rank (what autograd held saved at once, the metric every run logs),
and the simulator's makespan, bubble ratio and peak activations per rank (microbatch units,
``pp-core schedule simulate 1f1b --pp 4 -m 8 --seq-chunks K``), so the measured memory ratio
K / K=1 can be set against the predicted one, and the planner's predicted activation peak per
rank in bytes (the model profiled once at one row, then ``pp_core.planning.choose.predict`` of
1F1B with K on the runs' split, two blocks per stage: a slice costed as ``1/K`` of a microbatch,
``ModelProfile.sliced``) against the measured one. The last rows train K = 1 with activation
checkpointing of every block (``torch.utils.checkpoint``), the other way to the same memory.

    python benchmarks/bench_seq_slices.py [--seq 256] [--dim 64] [--steps 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

CHUNKS = (1, 2, 4, 8)


def measure(seq: int, dim: int, steps: int, chunks: int, checkpoint: bool) -> dict:
    """On every rank: train ``steps`` steps; the median step time and this rank's peak."""
    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    from pp_core import PipelineConfig, build_pipeline
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=dim, num_layers=8, num_heads=4, max_seq_len=seq)
    if checkpoint:  # every block recomputed in the backward: the AC way to less memory
        for block in model.layers.values():
            forward = block.forward
            block.forward = lambda *a, forward=forward: run_checkpointed(
                forward, *a, use_reentrant=False)
    config = PipelineConfig(pp_schedule="1f1b", pp_batch_size=8, pp_microbatch_size=1,
                            loss_fn="cross_entropy", pp_seq_chunks=chunks)
    pipe = build_pipeline(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (8, seq), generator=gen)
    times, peaks = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(ids, target=ids)
        dist.barrier()
        times.append(time.perf_counter() - start)
        peaks.append(pipe.saved_bytes.peak)
    return {"step_s": statistics.median(times[1:] or times), "peak_saved_bytes": max(peaks)}


def planned(seq: int, dim: int) -> dict:
    """``{K: the planner's predicted activation bytes per rank}`` for the benchmark's model and
    1F1B at pp 4, 8 microbatches (the profile measured here, in this process)."""
    import torch

    from pp_core.losses import resolve_loss
    from pp_core.measure.profile import profile_model
    from pp_core.planning.candidate import Option
    from pp_core.planning.choose import predict, schedule_defs
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, dim=dim, num_layers=8, num_heads=4, max_seq_len=seq)
    ids = torch.randint(0, 256, (1, seq))
    profile = profile_model(model, ids, ids, resolve_loss("cross_entropy"), [1], repeats=1)[1]
    defs = schedule_defs()
    split = [[f"layers.{i}" for i in (2 * s, 2 * s + 1)] for s in range(4)]  # as the runs'
    split[0][:0], split[-1][2:] = ["tok_embeddings", "pos_embeddings"], ["norm", "output"]
    return {k: [m.activations for m in predict(Option("1f1b", 1, 1, 8, k), defs["1f1b"],
                                               profile, 4, split).memory] for k in CHUNKS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    from pp_core.schedule.build import build_schedule
    from pp_core.schedule.simulate import simulate
    from pp_core.testing import DistPool

    rows = []
    plan = planned(args.seq, args.dim)
    with DistPool(4) as pool:
        for chunks, checkpoint in [(k, False) for k in CHUNKS] + [(1, True)]:
            ranks = pool.run(measure, args.seq, args.dim, args.steps, chunks, checkpoint)
            sim = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8,
                                          seq_chunks=chunks))
            rows.append({"K": chunks, "activation_checkpointing": checkpoint,
                         "step_s": max(r["step_s"] for r in ranks),
                         "peak_saved_bytes": [r["peak_saved_bytes"] for r in ranks],
                         "planned_bytes": None if checkpoint else plan[chunks],
                         "simulated": {"makespan": sim.makespan,
                                       "bubble_ratio": round(sim.bubble_ratio, 3),
                                       "peak_activations": sim.peak_activations}})
    base = rows[0]
    print(f"pp 4, 1f1b, 8 microbatches of 1 row x {args.seq} tokens, GPT dim {args.dim}")
    print(f"{'K':>2} {'AC':>3} {'step ms':>8} {'worst peak MiB':>15} {'x K=1':>6} "
          f"{'sim peak x K=1':>15} {'sim bubble':>10} {'planned worst MiB':>18}")
    for row in rows:
        worst = max(row["peak_saved_bytes"])
        ratio = worst / max(base["peak_saved_bytes"])
        plan_mib = f"{max(row['planned_bytes']) / 2**20:.2f}" if row["planned_bytes"] else "-"
        predicted = max(row["simulated"]["peak_activations"]) / \
            max(base["simulated"]["peak_activations"])
        print(f"{row['K']:>2} {'yes' if row['activation_checkpointing'] else 'no':>3} "
              f"{row['step_s'] * 1000:>8.0f} {worst / 2**20:>15.2f} {ratio:>6.2f} "
              f"{predicted:>15.2f} {row['simulated']['bubble_ratio']:>10} "
              f"{plan_mib:>18}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
