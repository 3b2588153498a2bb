"""pp-core's runtime against torch.distributed.pipelining, side by side in one run.

Same model (8 residual MLP blocks, hidden 512, inner width 2048), weights, data (batch 256, 8 microbatches, MSE)
and schedule through the installed torch's schedule classes (its version is printed first and
kept in the JSON) and through pp-core, on 2 ranks (gloo, one
thread per rank), the two alternating step by step. Reported per schedule:

* step time: median over the measured steps (each step = slowest rank, from a common barrier),
  the ratio pp-core / torch (median of the per-pair ratios) and its spread (min..max, IQR);
* efficiency: the step time pp_core.schedule.simulate predicts from per-stage F/B/I/W costs
  measured on one process (rank 0 alone, rank 1 idle), divided by the measured step time;
* first step (torch's includes its shape inference; pp-core's its first headers);
* peak memory per rank during a step (CPU: growth of the peak resident set over the step,
  reset through /proc/self/clear_refs; CUDA: max_memory_allocated);
* the receive-buffer bytes torch's stages hold after a step (its ``_RecvInfo`` buffers: one set
  per microbatch up to 2.14, none from 2.15 on, which allocates each just in time).

Also the lowering speed (pp=64, 2 stages per rank, 1024 microbatches) and I+W against B.

    python benchmarks/bench_runtime.py [--steps 10] [--schedules 1f1b,gpipe] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HIDDEN = int(os.environ.get("BENCH_HIDDEN", 512))
# The MLP's inner width. 4 x hidden (a transformer MLP) is the scale of issue 4's reference
# figures (torch 1F1B ~0.45 s a step on this machine); BENCH_FFN=512 is the lighter variant.
FFN = int(os.environ.get("BENCH_FFN", 4 * HIDDEN))
BLOCKS, BATCH, MICROBATCHES = 8, 256, 8
# pp-core name, torch class, stages per rank
SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1),
    "gpipe": ("ScheduleGPipe", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 2),
    "v_schedule": ("ScheduleZBVZeroBubble", 2),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def mse(output, target):
    return ((output - target) ** 2).mean()


def stage_ranks(placement, num_stages, num_ranks):
    from pp_core.schedule.ir import stage_to_rank

    return stage_to_rank(placement, num_stages, num_ranks)


def fqns(num_stages):
    per = BLOCKS // num_stages
    return [[str(i) for i in range(s * per, (s + 1) * per)] for s in range(num_stages)]


def part(model, names):
    from collections import OrderedDict

    return nn.Sequential(OrderedDict((n, model[int(n)]) for n in names))


# ------------------------------------------------------------------------------ memory
def _status(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak memory growth during a block: CUDA allocator stats, else peak RSS (Linux)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as handle:
                    handle.write("5")
            except OSError:
                pass
            self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _status("VmHWM") - self.base


# ------------------------------------------------------------------------------ builders
def build_torch(model, name, rank, num_ranks, device):
    from torch.distributed import pipelining

    cls_name, per_rank = SCHEDULES[name]
    num_stages = num_ranks * per_rank
    ranks = stage_ranks("v" if name == "v_schedule" else "loop", num_stages, num_ranks)
    mine = [s for s in range(num_stages) if ranks[s] == rank]
    names = fqns(num_stages)
    stages = [pipelining.PipelineStage(part(model, names[s]).to(device), s, num_stages, device)
              for s in mine]
    cls = getattr(pipelining, cls_name)
    arg = stages if per_rank > 1 else stages[0]
    kwargs = {} if name == "gpipe" else {}
    schedule = cls(arg, n_microbatches=MICROBATCHES, loss_fn=mse, scale_grads=False, **kwargs)
    first, last = 0 in mine, num_stages - 1 in mine
    modules = [s.submod for s in stages]

    def step(x, y):
        args = (x,) if first else ()
        if last:
            losses = []
            schedule.step(*args, target=y, losses=losses, return_outputs=False)
            return torch.stack(losses).mean()
        schedule.step(*args, return_outputs=False)
        return None

    step.stages = stages
    return step, modules, mine


def torch_held_recv_bytes(stages) -> int:
    """Bytes of the receive buffers torch's stages hold (activations and gradients, every
    microbatch) - read between steps."""
    held = 0
    for stage in stages:
        for infos in [*getattr(stage, "args_recv_info", {}).values(),
                      *getattr(stage, "grad_recv_info", {}).values()]:
            for info in infos if isinstance(infos, (tuple, list)) else (infos,):
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    held += buffer.numel() * buffer.element_size()
    return held


def build_pp_core(model, name, device, static=False):
    from pp_core import PipelineConfig, build_pipeline

    per_rank = SCHEDULES[name][1]
    config = PipelineConfig(pp_schedule=name, pp_batch_size=BATCH,
                            pp_microbatch_size=BATCH // MICROBATCHES, loss_fn=mse,
                            module_fqns_per_model_part=fqns(dist.get_world_size() * per_rank),
                            pp_seq_len=1 if static else None)
    pipe = build_pipeline(model, config, device=device)
    return (lambda x, y: pipe.step(x, target=y)), pipe.model_parts, pipe


# ------------------------------------------------------------------------------ costs
def stage_costs(model, stages, device, reps=16):
    """Median F, B, I, W seconds of one microbatch through each of ``stages``; gradients are
    zeroed (set to None) every ``MICROBATCHES`` microbatches, as in a step."""
    from pp_core.runtime.backward import backward_full, backward_input, backward_weight

    num_stages, mine = stages
    names = fqns(num_stages)
    mb = BATCH // MICROBATCHES
    x0 = torch.randn(mb, HIDDEN, device=device)
    grad = torch.randn(mb, HIDDEN, device=device)
    target = torch.randn(mb, HIDDEN, device=device)
    costs = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for s in mine:
        module = part(copy.deepcopy(model), names[s]).to(device)
        samples = {"F": [], "B": [], "I": [], "W": []}
        for rep in range(reps + 2):
            for split in (False, True):
                x = x0.clone().requires_grad_(s > 0)
                sync()
                t0 = time.perf_counter()
                out = module(x)
                if s == num_stages - 1:
                    out = mse(out, target)
                sync()
                t1 = time.perf_counter()
                outs, grads = [out], ([grad] if s < num_stages - 1 else None)
                inputs = [x] if s > 0 else []
                if split:
                    _, state = backward_input(outs, grads, inputs)
                    sync()
                    t2 = time.perf_counter()
                    backward_weight(state)
                    sync()
                    t3 = time.perf_counter()
                    if rep >= 2:
                        samples["I"].append(t2 - t1)
                        samples["W"].append(t3 - t2)
                else:
                    backward_full(outs, grads, inputs)
                    sync()
                    t2 = time.perf_counter()
                    if rep >= 2:
                        samples["F"].append(t1 - t0)
                        samples["B"].append(t2 - t1)
            if rep % MICROBATCHES == 0:
                module.zero_grad(set_to_none=True)
        costs[s] = {k: statistics.median(v) for k, v in samples.items()}
    return costs


def measure_costs(model, num_stages, rank, num_ranks, device):
    """Per-stage costs two ways: rank 0 alone for every stage (the other rank idle), and each
    rank for its own stages while the other rank measures too (the contention of a real run)."""
    ranks = stage_ranks("loop", num_stages, num_ranks)
    alone = None
    if rank == 0:
        alone = stage_costs(model, (num_stages, range(num_stages)), device)
    dist.barrier()
    mine = stage_costs(model, (num_stages, [s for s in range(num_stages) if ranks[s] == rank]),
                       device)
    gathered = [None] * num_ranks
    dist.all_gather_object(gathered, mine)
    together = {s: c for costs in gathered for s, c in costs.items()}
    return alone, together


def predicted(name, num_ranks, costs, latency=0.0):
    from pp_core.schedule.build import build_schedule
    from pp_core.schedule.simulate import Costs, simulate

    per_rank = SCHEDULES[name][1]
    schedule = build_schedule(name, num_ranks=num_ranks, num_microbatches=MICROBATCHES,
                              stages_per_rank=per_rank)
    return simulate(schedule, Costs(per_stage=costs), comm_latency=latency).makespan


def one_way_latency(device, reps=50):
    """Half the median round trip of one microbatch's activation between ranks 0 and 1."""
    group = dist.group.WORLD
    buffer = torch.zeros(BATCH // MICROBATCHES, HIDDEN, device=device)
    rank = dist.get_rank()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            group.send([buffer], 1, 9).wait()
            group.recv([buffer], 1, 9).wait()
        elif rank == 1:
            group.recv([buffer], 0, 9).wait()
            group.send([buffer], 0, 9).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


# ------------------------------------------------------------------------------ ranks
def timed(step, modules, x, y, device, memory=False):
    for module in modules:
        module.zero_grad(set_to_none=True)
    dist.barrier()
    with PeakMemory(device) if memory else _nothing() as peak:
        start = time.perf_counter()
        step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    t = torch.tensor([elapsed, float(getattr(peak, "peak", 0))], dtype=torch.float64)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return max(g[0].item() for g in gathered), [g[1].item() for g in gathered]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


CONTENDERS = ("torch", "pp_core", "pp_core_static")


def build(key, model, name, rank, num_ranks, device):
    if key == "torch":
        step, modules, _ = build_torch(model, name, rank, num_ranks, device)
        return step, modules
    step, modules, _ = build_pp_core(model, name, device, static=key == "pp_core_static")
    return step, modules


def join_and_make_data(rank, num_ranks, store_path, args):
    """One thread, the gloo group, this rank's device, the model and the step's batch (seeded)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=num_ranks)
    device = torch.device(args.device if args.device != "cuda" else f"cuda:{rank}")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, HIDDEN, generator=generator).to(device)
    y = torch.randn(BATCH, HIDDEN, generator=generator).to(device)
    return device, make_model(), x, y


def worker(rank, num_ranks, store_path, args, results_path):
    """Timing: the three contenders alternate step by step (order rotated every step)."""
    device, model, x, y = join_and_make_data(rank, num_ranks, store_path, args)
    report = {}
    latency = one_way_latency(device)
    costs = {n: measure_costs(model, n, rank, num_ranks, device)
             for n in sorted({num_ranks * SCHEDULES[s][1] for s in args.schedules})}
    for name in args.schedules:
        entry = {"latency": latency}
        entry["alone"], entry["together"] = costs[num_ranks * SCHEDULES[name][1]]
        built = {key: build(key, copy.deepcopy(model), name, rank, num_ranks, device)
                 for key in CONTENDERS}
        for key in CONTENDERS:  # first steps: torch's shape inference, pp-core's first headers
            entry[key + "_first"] = timed(*built[key], x, y, device)[0]
            entry[key] = []
        for _ in range(args.warmup):
            for key in CONTENDERS:
                timed(*built[key], x, y, device)
        for i in range(args.steps):
            order = CONTENDERS[i % 3:] + CONTENDERS[:i % 3]
            for key in order:
                entry[key].append(timed(*built[key], x, y, device)[0])
        report[name] = entry
        del built
    if rank == 0:
        for name, entry in report.items():
            entry["predicted_alone"] = predicted(name, num_ranks, entry["alone"])
            entry["predicted_together"] = predicted(name, num_ranks, entry["together"])
            entry["predicted_latency"] = predicted(name, num_ranks, entry["alone"],
                                                   entry["latency"])
        with open(results_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


def memory_worker(rank, num_ranks, store_path, args, results_path):
    """Peak memory of a step per rank, one framework at a time (run with a low
    MALLOC_MMAP_THRESHOLD_ so freed tensors leave the resident set at once)."""
    import gc

    device, model, x, y = join_and_make_data(rank, num_ranks, store_path, args)
    report = {}
    for name in args.schedules:
        for key in CONTENDERS:
            copied = copy.deepcopy(model)
            gc.collect()
            dist.barrier()
            with PeakMemory(device) as peak:  # build + first step + two steps
                step, modules = build(key, copied, name, rank, num_ranks, device)
                for _ in range(3):
                    timed(step, modules, x, y, device)
            steady = max(timed(step, modules, x, y, device, memory=True)[1][rank]
                         for _ in range(2))
            held = torch_held_recv_bytes(step.stages) if key == "torch" else 0
            values = torch.tensor([float(peak.peak), steady, float(held)], dtype=torch.float64)
            gathered = [torch.zeros_like(values) for _ in range(num_ranks)]
            dist.all_gather(gathered, values)
            report.setdefault(name, {})[key] = {
                "with_first_step": [g[0].item() for g in gathered],
                "steady_step": [g[1].item() for g in gathered],
                "held_recv_bytes": [g[2].item() for g in gathered]}
            del step, modules, copied
            gc.collect()
    if rank == 0:
        with open(results_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


def quantile(values, q):
    values = sorted(values)
    index = (len(values) - 1) * q
    lo = int(index)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (index - lo)


def summarise(report, memory):
    rows = {}
    mib = lambda values: [round(v / 2**20, 1) for v in values]
    for name, e in report.items():
        torch_med = statistics.median(e["torch"])
        row = {"torch_class": SCHEDULES[name][0], "steps": len(e["torch"]),
               "torch_step_s": round(torch_med, 4),
               "predicted_step_s_alone": round(e["predicted_alone"], 4),
               "predicted_step_s_together": round(e["predicted_together"], 4),
               "predicted_step_s_with_latency": round(e["predicted_latency"], 4),
               "one_way_latency_ms": round(e["latency"] * 1e3, 3),
               "efficiency_torch": round(e["predicted_alone"] / torch_med, 3),
               "efficiency_torch_together": round(e["predicted_together"] / torch_med, 3),
               "first_step_torch_s": round(e["torch_first"], 4),
               "peak_mem_torch_mib": mib(memory[name]["torch"]["with_first_step"]),
               "steady_mem_torch_mib": mib(memory[name]["torch"]["steady_step"]),
               "torch_held_recv_mib": mib(memory[name]["torch"]["held_recv_bytes"])}
        for key in ("pp_core", "pp_core_static"):
            ratios = [p / t for p, t in zip(e[key], e["torch"])]
            med = statistics.median(e[key])
            row.update({
                f"{key}_step_s": round(med, 4),
                f"{key}_ratio_median": round(statistics.median(ratios), 3),
                f"{key}_ratio_min": round(min(ratios), 3),
                f"{key}_ratio_max": round(max(ratios), 3),
                f"{key}_ratio_iqr": [round(quantile(ratios, 0.25), 3),
                                     round(quantile(ratios, 0.75), 3)],
                f"{key}_efficiency": round(e["predicted_alone"] / med, 3),
                f"{key}_efficiency_together": round(e["predicted_together"] / med, 3),
                f"{key}_efficiency_with_latency": round(e["predicted_latency"] / med, 3),
                f"{key}_first_step_s": round(e[key + "_first"], 4),
                f"{key}_peak_mem_mib": mib(memory[name][key]["with_first_step"]),
                f"{key}_steady_mem_mib": mib(memory[name][key]["steady_step"]),
            })
        row["stage_costs_ms_alone"] = {s: {k: round(v * 1e3, 3) for k, v in c.items()}
                                       for s, c in e["alone"].items()}
        row["stage_costs_ms_together"] = {s: {k: round(v * 1e3, 3) for k, v in c.items()}
                                          for s, c in e["together"].items()}
        rows[name] = row
    return rows


def lowering_speed():
    from pp_core.schedule.ir import Action, F, I, W, Schedule
    from pp_core.schedule.lower import lower

    p, v, m = 64, 2, 1024
    rows = []
    for r in range(p):
        stages = [r + i * p for i in range(v)]
        row = [Action(s, F, k) for s in stages for k in range(m)]
        row += [a for s in reversed(stages) for k in reversed(range(m))
                for a in (Action(s, I, k), Action(s, W, k))]
        rows.append(row)
    schedule = Schedule(rows, stage_ranks("loop", p * v, p), m, "bfs_split")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        lower(schedule)
        times.append(time.perf_counter() - start)
    return {"num_ranks": p, "stages_per_rank": v, "num_microbatches": m,
            "compute_actions": sum(len(r) for r in rows), "seconds_min": round(min(times), 3),
            "seconds_median": round(statistics.median(times), 3)}


def split_backward_overhead(reps=40):
    """CPU time of B and of I + W on one stage (4 blocks, one microbatch), one thread."""
    from pp_core.runtime.backward import backward_full, backward_input, backward_weight

    torch.set_num_threads(1)
    stage = part(make_model(), [str(i) for i in range(4)])
    x0, g = torch.randn(BATCH // MICROBATCHES, HIDDEN), torch.randn(BATCH // MICROBATCHES, HIDDEN)
    clock = time.thread_time

    def once(split):
        x = x0.clone().requires_grad_()
        y = stage(x)
        start = clock()
        if split:
            _, state = backward_input([y], [g], [x])
            middle = clock()
            backward_weight(state)
            return middle - start, clock() - middle
        backward_full([y], [g], [x])
        return clock() - start, 0.0

    for _ in range(5):
        once(True), once(False)
    b = [once(False)[0] for _ in range(reps)]
    iw = [once(True) for _ in range(reps)]
    B = statistics.median(b)
    I = statistics.median(a for a, _ in iw)
    W = statistics.median(w for _, w in iw)
    return {"B_ms": round(B * 1e3, 3), "I_ms": round(I * 1e3, 3), "W_ms": round(W * 1e3, 3),
            "I_plus_W_over_B": round((I + W) / B, 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--static", action="store_true",
                        help="give pp-core static shapes (pp_seq_len), as torch assumes")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    num_ranks = 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        results_path = os.path.join(tmp, "results.json")
        mp.spawn(worker, args=(num_ranks, os.path.join(tmp, "store"), args, results_path),
                 nprocs=num_ranks, join=True)
        with open(results_path) as handle:
            report = json.load(handle)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "4096"  # freed tensors leave RSS at once
        try:
            memory_path = os.path.join(tmp, "memory.json")
            mp.spawn(memory_worker, args=(num_ranks, os.path.join(tmp, "store_mem"), args,
                                          memory_path), nprocs=num_ranks, join=True)
        finally:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        with open(memory_path) as handle:
            memory = json.load(handle)
    result = {
        "config": {"blocks": BLOCKS, "hidden": HIDDEN, "ffn": FFN, "batch": BATCH,
                   "microbatches": MICROBATCHES, "ranks": num_ranks, "threads_per_rank": 1,
                   "device": args.device, "torch": torch.__version__, "steps": args.steps,
                   "cpus": os.cpu_count(), "load_average_before": load_before,
                   "load_average_after": os.getloadavg()},
        "schedules": summarise(report, memory),
        "lowering": lowering_speed(),
        "split_backward": split_backward_overhead(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    print()
    print(f"torch {torch.__version__} (its schedule classes are the 'torch' columns), "
          f"{num_ranks} ranks, load average {load_before[0]:.1f} before the run")
    print(f"{'schedule':<17}{'torch s':>8}{'pp s':>7}{'ratio':>6}{'range':>11}"
          f"{'static s':>9}{'ratio':>6}{'eff':>5}{'eff2':>5}{'eff3':>5}{'eff t':>6}"
          f"{'first t/pp/st':>17}"
          f"{'peak MiB t/pp/st (rank 0, rank 1)':>40}")
    for name, r in result["schedules"].items():
        first = f"{r['first_step_torch_s']:.2f}/{r['pp_core_first_step_s']:.2f}/" \
                f"{r['pp_core_static_first_step_s']:.2f}"
        mem = " ".join(f"{a:.0f}/{b:.0f}/{c:.0f}" for a, b, c in zip(
            r["peak_mem_torch_mib"], r["pp_core_peak_mem_mib"], r["pp_core_static_peak_mem_mib"]))
        print(f"{name:<17}{r['torch_step_s']:>8.3f}{r['pp_core_step_s']:>7.3f}"
              f"{r['pp_core_ratio_median']:>6.2f} {r['pp_core_ratio_min']:>4.2f}-"
              f"{r['pp_core_ratio_max']:<5.2f}{r['pp_core_static_step_s']:>9.3f}"
              f"{r['pp_core_static_ratio_median']:>6.2f}{r['pp_core_efficiency']:>5.2f}"
              f"{r['pp_core_efficiency_together']:>5.2f}"
              f"{r['pp_core_efficiency_with_latency']:>5.2f}{r['efficiency_torch']:>6.2f}"
              f"{first:>17}{mem:>40}")
    print("ratio = pp-core / torch step time (median of paired ratios, range min-max); static = "
          "pp_seq_len set; eff = simulated / measured with costs measured alone, eff2 = with "
          "costs measured while both ranks compute, eff3 = costs alone plus the measured one-way "
          "latency per hand-over; eff t = torch's (costs alone)")
    lowering = result["lowering"]
    held = ", ".join(f"{name} {'/'.join(f'{v:.1f}' for v in r['torch_held_recv_mib'])}"
                     for name, r in result["schedules"].items())
    print(f"receive buffers torch holds after a step, MiB per rank: {held}")
    print(f"\nlowering pp=64 v=2 m=1024 ({lowering['compute_actions']} compute actions): "
          f"{lowering['seconds_median']} s")
    sb = result["split_backward"]
    print(f"split backward on 4 blocks: B {sb['B_ms']} ms, I {sb['I_ms']} ms, W {sb['W_ms']} ms, "
          f"(I+W)/B = {sb['I_plus_W_over_B']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
