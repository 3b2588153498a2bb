"""Receive-buffer memory per stage with and without the pool, for every schedule (pp=4, m=16).

Run by hand: ``python benchmarks/bench_buffer_pool.py [--pp 4] [--microbatches 16] [--slack 2]
[--seq 256] [--hidden 1024] [--skip-run] [--json FILE] [--markdown FILE]`` (about 3 minutes on
2 CPU cores); ``--from-json FILE`` re-prints the tables of a saved run.

Two parts:

1. **From the program alone** (pure Python, what ``pp-core schedule simulate --json`` reports):
   per rank, stage and direction, torch's buffer sets (one per microbatch), the lower bound
   (most receives live at once, posted..consumed) and the pool's sets (lower bound + slack). The
   ratio pool/torch is printed next to the lower-bound ratio and, for 1F1B, next to NeMo
   AutoModel's ring ``(num_stages - stage + slack) / num_microbatches``.
2. **A real step** on ``pp`` local gloo ranks (CPU), for every schedule and three allocators:
   ``torch`` (one buffer set per microbatch and direction, kept across steps, as torch's
   pipelining does), ``fresh`` (pp-core's default: a new buffer per message, freed once autograd
   is done with it) and ``pool``. Reported per rank: receive-buffer bytes the allocator holds
   after the step, and the peak resident memory of the second step above the memory held before
   the first (``/proc/self/status`` VmHWM reset through ``clear_refs``; glibc's mmap threshold is
   pinned so that freed tensors leave the resident set at once).

The model is a chain of cheap elementwise blocks (``tanh(x * w + b)`` over ``[seq, hidden]``), so
the receive buffers are a large share of the memory and the CPU time stays small.

The steps run pp-core's runtime on the installed torch (its version is printed first). *torch*
models torch 2.13-2.14's allocation; torch 2.15 allocates each receive buffer just before its
receive and drops it with its use (pytorch PR 193872), which is what *fresh* does, so against
2.15 compare the pool with *fresh* (benchmarks/bench_runtime.py reads the buffers torch's own
stages hold after a step).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

from _common import options, proc_status, reset_peak, write_json
from pp_core import hookimpl

MIB = 1024 * 1024
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble", "zb_h2",
             "v_schedule", "v_half", "v_min", "dualpipe_v", "csv"]
MODES = ["torch", "fresh", "pool"]


# ============================================================================ schedules


def bfs_zb_csv(num_ranks: int, num_microbatches: int) -> str:
    """A custom compute-only CSV (torchtitan's test-asset shape): loop placement, 2 stages per
    rank, breadth-first forwards, then backward split into I and W, weights deferred."""
    rows = []
    for rank in range(num_ranks):
        low, high = rank, rank + num_ranks
        mbs = range(num_microbatches)
        row = [f"{low}F{k}" for k in mbs] + [f"{high}F{k}" for k in mbs]
        row += [f"{high}I{k}" for k in mbs] + [f"{low}I{k}" for k in mbs]
        row += [f"{high}W{k}" for k in mbs] + [f"{low}W{k}" for k in mbs]
        rows.append(",".join(row))
    return "\r\n".join(rows) + "\r\n"


def build(name: str, num_ranks: int, num_microbatches: int, csv_path: str):
    from pp_core.schedule import build_schedule

    if name == "csv":
        return build_schedule(num_ranks=num_ranks, num_microbatches=num_microbatches,
                              csv_path=csv_path)
    return build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches)


# ============================================================================ part 1


def program_figures(num_ranks: int, num_microbatches: int, slack: int, csv_path: str) -> list:
    """Per schedule, rank, stage and direction: sets with and without the pool, bounds."""
    from pp_core.schedule.buffer_plan import recv_buffer_report
    from pp_core.schedule.lower import lower

    rows = []
    for name in SCHEDULES:
        program = lower(build(name, num_ranks, num_microbatches, csv_path))
        report = recv_buffer_report(program, slack)
        for rank in report["ranks"]:
            for cls in rank["classes"]:
                rows.append({"schedule": name, "rank": rank["rank"], **cls})
    return rows


# ============================================================================ part 2


class TorchLikeAllocator:
    """torch.distributed.pipelining's behaviour: one buffer set per microbatch and direction,
    allocated on first use and kept for the life of the stage (pytorch issue 136380)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.buffers: dict[int, list] = {}

    def allocate(self, lifetime, metas):
        held = self.buffers.get(lifetime)
        if held is None or [(tuple(t.shape), t.dtype) for t in held] != \
                [(tuple(m.shape), m.dtype) for m in metas]:
            held = [self.torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
            self.buffers[lifetime] = held
        return held

    def release(self, lifetime):
        pass

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.buffers.values() for t in ts)


class FreshCounter:
    """pp-core's default allocator, counting the bytes it hands out per step."""

    def __init__(self, device):
        from pp_core.runtime.allocator import DefaultRecvBufferAllocator

        self.inner = DefaultRecvBufferAllocator(device)
        self.bytes_per_step = 0

    def allocate(self, lifetime, metas):
        tensors = self.inner.allocate(lifetime, metas)
        self.bytes_per_step += sum(t.numel() * t.element_size() for t in tensors)
        return tensors

    def release(self, lifetime):
        pass

    def reset(self):
        pass


class AllocatorPlugin:
    """Answers ``pp_make_recv_buffer_allocator`` with one of the benchmark's allocators."""

    def __init__(self, factory):
        self.factory = factory

    @hookimpl
    def pp_make_recv_buffer_allocator(self, config, program, rank, device):
        return self.factory(device)


def _model(num_stages: int, hidden: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))
            self.bias = nn.Parameter(torch.zeros(hidden))

        def forward(self, x):
            return torch.tanh(x * self.weight + self.bias)

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(num_stages)])


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _run_case(name, mode, args, csv_path):
    import torch
    import torch.distributed as dist

    from pp_core import PipelineConfig
    from pp_core.plugin_manager import load_plugins
    from pp_core.runtime.build import build_pipeline

    plugins = None
    if mode != "pool":
        factory = TorchLikeAllocator if mode == "torch" else FreshCounter
        plugins = load_plugins(plugins=[AllocatorPlugin(factory)],
                               disabled=["pp_core_builtins.buffer_pool"])
    config = PipelineConfig(
        pp_schedule="1f1b" if name == "csv" else name,
        pp_schedule_csv=csv_path if name == "csv" else None,
        pp_batch_size=args.microbatches, pp_microbatch_size=1, loss_fn=_loss,
        pp_recv_buffer_pool=mode == "pool", pp_recv_buffer_pool_slack=args.slack,
        pp_seq_len=args.seq)
    schedule = build(name, args.pp, args.microbatches, csv_path)
    pipe = build_pipeline(_model(schedule.num_stages, args.hidden), config, plugins=plugins)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.microbatches, args.seq, args.hidden, generator=generator)
    target = torch.randn(args.microbatches, args.seq, args.hidden, generator=generator)
    gc.collect()
    dist.barrier()
    before = proc_status("VmRSS")
    pipe.step(inputs, target=target)  # first step: allocators fill up
    if mode == "fresh":
        pipe.allocator.bytes_per_step = 0
    gc.collect()
    dist.barrier()
    reset_peak()
    start = time.perf_counter()
    pipe.step(inputs, target=target)
    seconds = time.perf_counter() - start
    peak = proc_status("VmHWM") - before
    allocator = pipe.allocator
    per_stage: dict = {}
    if mode == "pool":
        report = allocator.report()
        for row in report:
            entry = per_stage.setdefault(row["stage"], {"pool_bytes": 0, "default_bytes": 0})
            entry["pool_bytes"] += row["pool_bytes"]
            entry["default_bytes"] += row["default_bytes"]
        held = allocator.nbytes
        per_step = sum(row["default_bytes"] for row in report)
        overflow = sum(row["overflow"] for row in report)
    elif mode == "torch":
        held = per_step = allocator.nbytes
        overflow = 0
    else:
        held, per_step, overflow = 0, allocator.bytes_per_step, 0
    del pipe
    gc.collect()
    return {"schedule": name, "mode": mode, "rank": dist.get_rank(), "held_bytes": held,
            "bytes_per_step": per_step, "peak_bytes": peak, "overflow": overflow,
            "per_stage": per_stage, "step_seconds": round(seconds, 4)}


def _worker(rank, args, store_path, csv_path, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=args.pp)
    _run_case("1f1b", "fresh", args, csv_path)  # warm-up: lazy initialisation stays out of it
    rows = []
    for name in SCHEDULES:
        for mode in MODES:
            rows.append(_run_case(name, mode, args, csv_path))
    gathered = [None] * args.pp
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump([row for rows in gathered for row in rows], out)
    dist.destroy_process_group()


def run_steps(args, csv_path: str) -> list:
    import torch.multiprocessing as mp

    # Freed tensors must leave the resident set at once for VmHWM to measure live memory.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "store"), csv_path, out_path),
                 nprocs=args.pp, join=True)
        with open(out_path) as rows:
            return json.load(rows)


# ============================================================================ tables


def _per_stage_program(rows) -> dict:
    """(schedule, stage) -> sets summed over both directions, from the program."""
    table: dict = {}
    for row in rows:
        entry = table.setdefault((row["schedule"], row["stage"]), {
            "rank": row["rank"], "default": 0, "lower": 0, "pool": 0, "nemo": 0})
        entry["default"] += row["default_sets"]
        entry["lower"] += row["lower_bound"]
        entry["pool"] += row["pool_sets"]
        entry["nemo"] += row["nemo_ring"]
    return table


def markdown(program_rows, step_rows, args) -> str:
    m, slack = args.microbatches, args.slack
    program = _per_stage_program(program_rows)
    num_stages = {name: 1 + max(s for (n, s) in program if n == name) for name in SCHEDULES}
    width = max(num_stages.values())
    measured = {}
    for row in step_rows:
        if row["mode"] == "pool":
            for stage, entry in row["per_stage"].items():
                measured[(row["schedule"], int(stage))] = entry
    source = "measured in a real step" if measured else "from the program"
    lines = [
        f"torch {getattr(args, 'torch', '?')}. "
        f"pp={args.pp}, microbatches={m}, slack={slack}. Receive-buffer bytes per stage (both "
        f"directions), pool / torch ({source}; torch = one buffer set per microbatch and "
        f"direction), with the lower bound from the program in brackets (the most receives live "
        f"at once / torch's sets: no assignment of buffers can do better).",
        "",
        "| schedule | " + " | ".join(f"stage {s}" for s in range(width)) + " | all stages |",
        "|---|" + "---|" * (width + 1),
    ]
    for name in SCHEDULES:
        cells, pool_total, torch_total, bound_total = [], 0, 0, 0
        for stage in range(width):
            entry = program.get((name, stage))
            if entry is None:
                cells.append("" if stage >= num_stages[name] else "-")
                continue
            bound = entry["lower"] / entry["default"]
            if (name, stage) in measured:
                got = measured[(name, stage)]
                ratio = got["pool_bytes"] / got["default_bytes"]
            else:
                ratio = entry["pool"] / entry["default"]
            cells.append(f"{ratio:.3f} ({bound:.3f})")
            pool_total += ratio * entry["default"]
            torch_total += entry["default"]
            bound_total += entry["lower"]
        cells.append(f"{pool_total / torch_total:.3f} ({bound_total / torch_total:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"1F1B against NeMo AutoModel's ring of (num_stages - stage + slack) sets per direction:",
        "",
        "| stage | torch sets | pool sets | pool ratio | "
        "NeMo ratio (num_stages - stage + slack) / m |",
        "|---|---|---|---|---|",
    ]
    for stage in range(num_stages["1f1b"]):
        e = program[("1f1b", stage)]
        ratio = e["pool"] / e["default"]
        if ("1f1b", stage) in measured:
            got = measured[("1f1b", stage)]
            ratio = got["pool_bytes"] / got["default_bytes"]
        lines.append(f"| {stage} | {e['default']} | {e['pool']} | {ratio:.4f} | "
                     f"{e['nemo'] / e['default']:.4f} |")
    if step_rows:
        by = {(r["schedule"], r["rank"], r["mode"]): r for r in step_rows}
        lines += [
            "",
            f"Peak resident memory of a training step above the memory before the first step, "
            f"MiB per rank, torch / fresh / pool ({args.pp} gloo ranks on CPU, one message = "
            f"{args.seq}x{args.hidden} float32 = {args.seq * args.hidden * 4 / MIB:g} MiB). "
            f"*torch*: one set per microbatch and direction, kept across steps; *fresh*: "
            f"pp-core's default, a new buffer per message freed when autograd is done with it; "
            f"*pool*: this plugin. Receive buffers held between steps: torch / pool MiB.",
            "",
            "| schedule | " + " | ".join(f"rank {r} peak" for r in range(args.pp)) + " | "
            + " | ".join(f"rank {r} held" for r in range(args.pp)) + " |",
            "|---|" + "---|" * (2 * args.pp),
        ]
        for name in SCHEDULES:
            peaks, held = [], []
            for rank in range(args.pp):
                t, f, p = (by[(name, rank, mode)] for mode in MODES)
                peaks.append(" / ".join(f"{r['peak_bytes'] / MIB:.0f}" for r in (t, f, p)))
                held.append(f"{t['held_bytes'] / MIB:.0f} / {p['held_bytes'] / MIB:.0f}")
            lines.append(f"| {name} | " + " | ".join(peaks) + " | " + " | ".join(held) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = options(__doc__, pp=4, microbatches=16, slack=2, seq=256, hidden=1024)
    parser.add_argument("--skip-run", action="store_true", help="program figures only")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    parser.add_argument("--from-json", metavar="FILE",
                        help="only print the tables of figures saved earlier with --json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as saved:
            figures = json.load(saved)
        for key in ("pp", "microbatches", "slack", "seq", "hidden"):
            setattr(args, key, figures[key])
        args.torch = figures.get("torch", "?")
        print(markdown(figures["program"], figures["steps"], args))
        return 0
    import torch  # lazy: the version only; --from-json runs without torch

    args.torch = torch.__version__
    print(f"torch {args.torch}")
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = os.path.join(tmp, "bfs_zb.csv")
        with open(csv_path, "w", newline="") as fh:
            fh.write(bfs_zb_csv(args.pp, args.microbatches))
        program_rows = program_figures(args.pp, args.microbatches, args.slack, csv_path)
        step_rows = [] if args.skip_run else run_steps(args, csv_path)
    figures = {"torch": args.torch, "pp": args.pp, "microbatches": args.microbatches, "slack": args.slack,
               "seq": args.seq, "hidden": args.hidden, "program": program_rows,
               "steps": step_rows}
    print(json.dumps(figures))
    text = markdown(program_rows, step_rows, args)
    print(text)
    write_json(args.json, figures)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
