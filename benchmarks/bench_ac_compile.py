"""Activation checkpointing and torch.compile on the demo GPT, 2 gloo ranks, split backward.

The README demo's model (GPT: vocab 256, dim 192, 4 blocks, 6 heads, sequence 64), batch 16 in 8
microbatches, schedule ``v_schedule`` (ZB-V: I and W apart) unless ``--schedule`` says otherwise,
each rank one thread. Per configuration (AC none / full / selective, each eager and compiled):

* step time: median over the measured steps, after warm-up steps (the compiled first step
  includes compilation and is reported apart);
* peak memory per rank: growth of the peak resident set over one step (``/proc/self/status``,
  reset through ``clear_refs``), i.e. what the step's activations and gradients cost; the ranks
  run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set and it
  follows live memory (without it glibc keeps freed memory and the growth says little);
* forward calls per block per microbatch (eager only: compiled code runs no Python forward),
  for pp-core's checkpointing and, as the alternative, ``torch.utils.checkpoint``
  (non-reentrant) wrapped around each block by hand.

Also, on one process (fresh per mode), the memory a split backward holds: the demo's 4 blocks
run 4 microbatches' forwards, then every ``I``, then every ``W``; the resident set after each
phase, relative to before (``held``).

    python benchmarks/bench_ac_compile.py [--steps 6] [--schedule v_schedule] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import options, proc_status, reset_peak, write_json  # noqa: E402

MODEL = dict(vocab_size=256, dim=192, num_layers=4, num_heads=6, max_seq_len=64)
BATCH, MICROBATCH, SEQ = 16, 2, 64
CONFIGS = [("none", False), ("full", False), ("selective", False), ("torch_checkpoint", False),
           ("none", True), ("full", True), ("selective", True)]


def _count(block, counter):
    original = block.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.compiler.is_compiling():
            counter[0] += 1
        return original(*args, **kwargs)

    block.forward = forward


def run_config(schedule: str, ac: str, compiled: bool, steps: int, warmup: int) -> dict:
    """On every rank: build, wrap, step; timings, memory and forward-call counts."""
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from pp_core import PipelineConfig, build_pipeline
    from pp_core.parallel import ParallelSettings, find_blocks, parallelize
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=BATCH,
                            pp_microbatch_size=MICROBATCH, loss_fn="cross_entropy")
    pipe = build_pipeline(GPT(**MODEL), config)
    counter = [0]
    blocks = [block for part in pipe.model_parts for _, block in find_blocks(part)]
    for block in blocks:
        _count(block, counter)
    if ac == "torch_checkpoint":
        for block in blocks:
            inner = block.forward
            block.forward = lambda *a, inner=inner: checkpoint(inner, *a, use_reentrant=False)
    parallelize(pipe, None, ParallelSettings(  # torch's own checkpoint: no AC of ours
        activation_checkpointing="none" if ac == "torch_checkpoint" else ac,
        compile={} if compiled else None))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    times, peaks, first = [], [], None
    for step in range(warmup + steps):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        counter[0] = 0
        dist.barrier()
        reset_peak()
        base = proc_status("VmRSS")
        start = time.perf_counter()
        pipe.step(inputs, target=target)
        dist.barrier()
        elapsed = time.perf_counter() - start
        if step == 0:
            first = elapsed
        if step >= warmup:
            times.append(elapsed)
            peaks.append(proc_status("VmHWM") - base)
    calls = counter[0] / (len(blocks) * config.num_microbatches) if blocks else 0.0
    return {"step_s": statistics.median(times), "first_step_s": first,
            "peak_mib": max(peaks) / 2 ** 20, "forward_calls_per_block_per_mb": calls}


def held(mode: str) -> dict:
    """Resident MiB after the forwards, the I passes and the W passes (second of two rounds)."""
    import gc

    from pp_core.parallel import apply_activation_checkpointing
    from pp_core.runtime.backward import backward_input, backward_weight
    from pp_core_builtins.models.gpt import GPT

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*GPT(**MODEL).layers.values())
    apply_activation_checkpointing([blocks], mode)
    xs = [torch.randn(MICROBATCH, SEQ, MODEL["dim"]) for _ in range(4)]
    result = {}
    for _ in range(2):
        base = proc_status("VmRSS")
        inputs = [x.clone().requires_grad_() for x in xs]
        outputs = [blocks(x) for x in inputs]
        result["after_forwards"] = proc_status("VmRSS") - base
        states = [backward_input([o], [torch.ones_like(o)], [x])[1]
                  for o, x in zip(outputs, inputs)]
        del outputs
        gc.collect()
        result["after_I"] = proc_status("VmRSS") - base
        for state in states:
            backward_weight(state)
        del states
        gc.collect()
        result["after_W"] = proc_status("VmRSS") - base
    return {k: round(v / 2 ** 20, 1) for k, v in result.items()}


def main() -> None:
    parser = options(__doc__, steps=6, warmup=2, schedule="v_schedule", json=None)
    parser.add_argument("--held", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.held:
        print(json.dumps(held(args.held)))
        return
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the ranks
    from pp_core.testing import DistPool

    rows = []
    with DistPool(2, timeout=1800) as pool:
        for ac, compiled in CONFIGS:
            ranks = pool.run(run_config, args.schedule, ac, compiled, args.steps, args.warmup)
            rows.append({"ac": ac, "compile": compiled,
                         "step_s": max(r["step_s"] for r in ranks),
                         "first_step_s": max(r["first_step_s"] for r in ranks),
                         "peak_mib_per_rank": [round(r["peak_mib"], 1) for r in ranks],
                         "forward_calls_per_block_per_mb":
                             None if compiled else ranks[0]["forward_calls_per_block_per_mb"]})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.schedule}, demo GPT, 2 ranks, batch {BATCH} in {BATCH // MICROBATCH} "
          f"microbatches\n")
    print("| AC | compile | step time (median) | first step | peak memory per rank "
          "(step growth) | forward calls per block per microbatch |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        calls = row["forward_calls_per_block_per_mb"]
        print(f"| {row['ac']} | {'on' if row['compile'] else 'off'} | "
              f"{1000 * row['step_s']:.0f} ms | {1000 * row['first_step_s']:.0f} ms | "
              f"{' / '.join(f'{m:.1f} MiB' for m in row['peak_mib_per_rank'])} | "
              f"{'-' if calls is None else f'{calls:g}'} |")
    import subprocess

    print("\n| AC | held after 4 forwards | after their I | after their W |\n|---|---|---|---|")
    for mode in ("none", "full", "selective"):
        out = subprocess.run([sys.executable, __file__, "--held", mode], capture_output=True,
                             text=True, env=os.environ, check=True).stdout
        figures = json.loads(out.strip().splitlines()[-1])
        rows.append({"held": mode, **figures})
        print(f"| {mode} | {figures['after_forwards']} MiB | {figures['after_I']} MiB | "
              f"{figures['after_W']} MiB |")
    write_json(args.json, rows, indent=2)


if __name__ == "__main__":
    main()
