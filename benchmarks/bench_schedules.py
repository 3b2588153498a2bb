"""Schedule benchmarks: bubble ratios against the formulas and torch 2.13, and compile speed.

    python benchmarks/bench_schedules.py                 # everything (a few minutes)
    python benchmarks/bench_schedules.py --skip-torch    # pp-core only (seconds)
    python benchmarks/bench_schedules.py --json out.json --torch-timeout 120
    python benchmarks/bench_schedules.py --scale-only    # (c) alone (about a minute)

(a) Bubble table: every built-in schedule at pp in {2,4,8}, m in {pp,2pp,4pp,8pp}, default
    stages per rank, unit costs (F=I=W=1, B=2, no communication): pp-core's simulated bubble
    ratio, the closed-form formula (docs/schedules.md), and torch's schedule of the same name
    replayed by the same simulator. torch's order is its ``pipeline_order`` for the multi-stage
    classes and, for ScheduleGPipe / Schedule1F1B (whose declared IR is informational only and
    wrong on the last rank), the order its runtime loop executes, recorded by running
    ``_step_microbatches`` with stand-in stages whose forward/backward calls are logged.
(b) Compile speed: build (generate) + validate + lower every built-in at pp=64, m=1024 (2 stages
    per rank where the schedule takes 2); linear growth over m = 256, 512, 1024; torch's
    Interleaved1F1B (m=256, 1024) and ZBVZeroBubble (m=1024) construction + lowering
    (``_prepare_schedule_with_comms``), each in a subprocess with a timeout.

(c) Scale in pp: ``pp-core schedule simulate 1f1b --pp P --microbatches 1`` for P = 8k, 16k,
    32k, 100k as a user runs it (a fresh process: start-up and plugin loading included, and the
    same command at pp=2 for that start-up alone), and inside it build (generate + validate),
    simulate, and the figures and table (``to_dict`` + every rank's stages); also lower +
    receive-buffer report, which ``simulate --json`` adds.

torch's schedule classes only read ``num_stages``/``group_size``/``group_rank`` from their stages,
so they are built on ``mock.create_autospec(PipelineStage)`` objects exactly as torch's own
``_schedule_visualizer.get_schedule_ops`` does; no process group is needed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from pp_core.errors import PPCoreError
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import build_schedule, resolve_schedule_def
from pp_core.schedule.csv_io import parse_csv
from pp_core.schedule.simulate import simulate
from pp_core.schedule.validate import validate_schedule
from _common import write_json

# pp-core name -> torch class (None: torch has no such schedule)
TORCH_CLASS = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "dfs": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
    "zero_bubble": "ScheduleInterleavedZeroBubble", "v_schedule": "ScheduleZBVZeroBubble",
    "dualpipe_v": "ScheduleDualPipeV",
}
SINGLE_STAGE = {"ScheduleGPipe", "Schedule1F1B"}


def formula(name: str, p: int, m: int, v: int):
    """(ratio, expression, exact): the schedule's closed-form bubble, per-action unit costs."""
    work = 3 * v * m  # F + B (or F + I + W) per (stage, microbatch), v stages per rank
    if name in ("gpipe", "1f1b", "interleaved_1f1b", "dfs", "looped_bfs"):
        bubble, text = 3 * (p - 1), "(p-1)(F+B)"
    elif name == "zero_bubble":
        bubble, text = p - 1, "(p-1)(F+I-W)"
    elif name in ("zb_h2", "v_schedule"):
        bubble, text = p - 1, "(p-1)F (makespan; span 0)"
    elif name == "dualpipe_v":
        bubble, text = 2 * (p - 1), "(p-1)(F&B+B-3W), F&B=F+B"
    elif name == "v_half":
        r = formula("1f1b", p, m, 1)[0]
        return r / 2, "~1/2 of 1F1B's ratio", False
    elif name == "v_min":
        r = formula("1f1b", p, m, 1)[0]
        return 2 * r / 3, "~2/3 of 1F1B's ratio", False
    else:
        return None, "no formula", False
    return bubble / (work + bubble), text, True


# ----------------------------------------------------------------------------- torch orders


def _torch_stage(p: int, num_stages: int, rank: int = 0):
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = rank, p, None
    stage.num_stages, stage.device = num_stages, "cpu"
    return stage


def torch_order(cls_name: str, p: int, m: int, v: int) -> list[list[str]]:
    """Per-rank action strings ('' = idle) of torch's schedule ``cls_name``."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, cls_name)
    if cls_name in SINGLE_STAGE:
        return [_torch_runtime_order(cls, p, m, r) for r in range(p)]
    sched = cls([_torch_stage(p, p * v)] * v, m)
    return [["" if a is None else str(a) for a in sched.pipeline_order[r]] for r in range(p)]


def _torch_runtime_order(cls, p: int, m: int, rank: int) -> list[str]:
    """What Schedule1F1B/ScheduleGPipe's runtime loop executes on ``rank``."""
    log: list[str] = []
    stage = _torch_stage(p, p, rank)
    stage.stage_index, stage.is_first, stage.is_last = rank, rank == 0, rank == p - 1
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(stage, name).return_value = []
    stage.forward_one_chunk.side_effect = lambda i, *a, **k: log.append(f"{rank}F{i}")
    stage.backward_one_chunk.side_effect = lambda i, *a, **k: log.append(f"{rank}B{i}")
    sched = cls(stage, m, loss_fn=lambda out, target: out)
    sched._step_microbatches([()] * m, [{}] * m, [None] * m, [])
    return log


def _torch_time(cls_name: str, p: int, m: int, v: int) -> None:
    """Subprocess entry: print construction, then lowering time, as JSON lines."""
    from torch.distributed.pipelining import schedules

    stages = [_torch_stage(p, p * v)] * v
    t0 = time.perf_counter()
    sched = getattr(schedules, cls_name)(stages, m)
    t1 = time.perf_counter()
    print(json.dumps({"construct_s": t1 - t0}), flush=True)
    runtime = schedules._PipelineScheduleRuntime(stages, m)
    runtime._prepare_schedule_with_comms(sched.pipeline_order)
    print(json.dumps({"lower_s": time.perf_counter() - t1}), flush=True)


def time_torch(cls_name: str, p: int, m: int, v: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--torch-time", cls_name, str(p), str(m), str(v)]
    row = {"torch_class": cls_name, "pp": p, "microbatches": m, "stages_per_rank": v}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
        timed_out = False
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        timed_out = True
    for line in out.splitlines():
        if line.startswith("{"):
            row.update(json.loads(line))
    if timed_out:
        row["note"] = f"stopped after {timeout:.0f} s"
    elif "lower_s" in row:
        row["total_s"] = row["construct_s"] + row["lower_s"]
    return row


# ----------------------------------------------------------------------------- (a) bubble table


def bubble_table(names: list[str], with_torch: bool) -> list[dict]:
    rows = []
    for name in names:
        for p in (2, 4, 8):
            for m in (p, 2 * p, 4 * p, 8 * p):
                rows.append(_bubble_row(name, p, m, with_torch))
    return rows


def _bubble_row(name: str, p: int, m: int, with_torch: bool) -> dict:
    row: dict = {"schedule": name, "pp": p, "microbatches": m}
    try:
        schedule = build_schedule(name, num_ranks=p, num_microbatches=m)
    except PPCoreError as exc:
        row["note"] = f"pp-core: {str(exc).splitlines()[0]}"
        return row
    v = schedule.num_stages // p
    result = simulate(schedule)
    ratio, text, exact = formula(name, p, m, v)
    row.update(stages_per_rank=v, bubble_ratio=round(result.bubble_ratio, 4),
               span_bubble=result.span_bubble, peak=max(result.peak_activations),
               formula=text, formula_ratio=None if ratio is None else round(ratio, 4),
               formula_exact=exact)
    if exact and ratio is not None:
        row["matches_formula"] = abs(ratio - result.bubble_ratio) < 1e-9
    torch_cls = TORCH_CLASS.get(name)
    if with_torch and torch_cls:
        row["torch_class"] = torch_cls
        try:
            order = torch_order(torch_cls, p, m, v)
        except Exception as exc:  # torch refuses this size
            row["torch_note"] = f"torch: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            return row
        try:
            theirs = parse_csv("\n".join(",".join(r) for r in order) + "\n", name=torch_cls)
        except PPCoreError as exc:
            row["torch_note"] = f"torch order invalid: {str(exc).splitlines()[0][:120]}"
            return row
        tres = simulate(theirs)
        row.update(torch_bubble_ratio=round(tres.bubble_ratio, 4),
                   torch_peak=max(tres.peak_activations),
                   same_order=theirs.rows() == schedule.rows())
    return row


# ----------------------------------------------------------------------------- (b) compile speed


def _lower():
    try:
        from pp_core.schedule.lower import lower
    except ImportError:
        return None
    return lower


def compile_speed(names: list[str], p: int, m: int) -> list[dict]:
    plugins = default_plugins()
    lower = _lower()
    rows = []
    for name in names:
        sdef = resolve_schedule_def(name, plugins)[1]
        v = 2 if (sdef.stages_per_rank == 2 or sdef.variable_stages_per_rank) else 1
        row = {"schedule": name, "pp": p, "microbatches": m, "stages_per_rank": v}
        t0 = time.perf_counter()
        try:
            schedule = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        except PPCoreError as exc:
            row["note"] = str(exc).splitlines()[0]
            rows.append(row)
            continue
        t1 = time.perf_counter()
        validate_schedule(schedule)  # build_schedule validated once; time one more pass alone
        t2 = time.perf_counter()
        row["actions"] = sum(len(r) for r in schedule.actions)
        row["build_s"] = round(t1 - t0, 4)  # generate + validate
        row["validate_s"] = round(t2 - t1, 4)
        if lower is not None:
            lower(schedule)
            row["lower_s"] = round(time.perf_counter() - t2, 4)
            row["total_s"] = round(row["build_s"] + row["lower_s"], 4)
        else:
            row["note"] = "pp_core.schedule.lower not available: lowering not timed"
        rows.append(row)
    return rows


def growth(names: list[str], p: int) -> list[dict]:
    out = []
    for m in (256, 512, 1024):
        for row in compile_speed(names, p, m):
            out.append({k: row.get(k) for k in ("schedule", "microbatches", "actions",
                                                "total_s", "build_s", "note")})
    return out


# ----------------------------------------------------------------------------- (c) scale in pp

SCALE_PP = (8_000, 16_000, 32_000, 100_000)


def _command_s(p: int) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of the command in a fresh process: on a shared
    machine the CPU time is the steadier figure."""
    import resource

    cmd = [sys.executable, "-m", "pp_core", "schedule", "simulate", "1f1b", "--pp", str(p),
           "--microbatches", "1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return round(wall, 3), round(cpu, 3)


def scale(pps=SCALE_PP) -> list[dict]:
    from pp_core.schedule.buffer_plan import recv_buffer_report

    lower = _lower()
    default_plugins()  # loaded once, as the command does before its work
    startup, startup_cpu = _command_s(2)
    rows = []
    for p in pps:
        wall, cpu = _command_s(p)
        row = {"pp": p, "command_s": wall, "command_cpu_s": cpu, "startup_s": startup,
               "startup_cpu_s": startup_cpu}
        t0 = time.perf_counter()
        schedule = build_schedule("1f1b", num_ranks=p, num_microbatches=1)
        t1 = time.perf_counter()
        result = simulate(schedule)
        t2 = time.perf_counter()
        result.to_dict()
        for rank in range(p):
            schedule.stages_of(rank)
        t3 = time.perf_counter()
        row.update(build_s=round(t1 - t0, 3), simulate_s=round(t2 - t1, 3),
                   figures_s=round(t3 - t2, 3), work_s=round(t3 - t0, 3))
        if lower is not None:
            recv_buffer_report(lower(schedule))
            row["json_extra_s"] = round(time.perf_counter() - t3, 3)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def _table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    return "\n".join(line.rstrip() for line in lines)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-torch", action="store_true", help="pp-core figures only")
    parser.add_argument("--torch-timeout", type=float, default=60.0,
                        help="seconds allowed per torch construction+lowering (default 60)")
    parser.add_argument("--json", metavar="FILE", help="also write the JSON here")
    parser.add_argument("--scale-only", action="store_true",
                        help="only (c): simulate 1f1b at pp 8k..100k")
    parser.add_argument("--torch-time", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torch_time:
        cls, p, m, v = args.torch_time
        _torch_time(cls, int(p), int(m), int(v))
        return 0
    scale_columns = ["pp", "command_s", "command_cpu_s", "startup_s", "startup_cpu_s", "build_s",
                     "simulate_s", "figures_s", "work_s", "json_extra_s"]
    if args.scale_only:
        report = {"scale": scale()}
        print(write_json(args.json, report))
        print()
        print(_table(report["scale"], scale_columns))
        return 0
    names = default_plugins().schedules.names()
    with_torch = not args.skip_torch
    report = {"schedules": names}
    report["bubble"] = bubble_table(names, with_torch)
    report["compile"] = compile_speed(names, 64, 1024)
    report["growth"] = growth(["interleaved_1f1b", "zero_bubble", "v_schedule"], 64)
    report["scale"] = scale()
    if with_torch:
        t = args.torch_timeout
        report["torch_compile"] = [
            time_torch("ScheduleInterleaved1F1B", 64, 256, 2, t),
            time_torch("ScheduleInterleaved1F1B", 64, 1024, 2, t),
            time_torch("ScheduleZBVZeroBubble", 64, 1024, 2, t),
        ]
        ours = {(r["schedule"], r["microbatches"]): r.get("total_s") for r in report["growth"]}
        for row in report["torch_compile"]:
            mine = ours.get(("interleaved_1f1b" if "Interleaved" in row["torch_class"]
                             else "v_schedule", row["microbatches"]))
            row["pp_core_total_s"] = mine
            if mine and row.get("total_s"):
                row["speedup"] = round(row["total_s"] / mine, 1)
            elif mine and "note" in row:
                row["speedup"] = f"> {args.torch_timeout / mine:.0f}"
    print(write_json(args.json, report))
    print()
    print(_table(report["bubble"], ["schedule", "pp", "microbatches", "stages_per_rank",
                                    "bubble_ratio", "formula_ratio", "matches_formula",
                                    "torch_bubble_ratio", "same_order", "peak", "torch_peak",
                                    "note", "torch_note"]))
    print()
    print(_table(report["compile"], ["schedule", "stages_per_rank", "actions", "build_s",
                                     "validate_s", "lower_s", "total_s", "note"]))
    print()
    print(_table(report["growth"], ["schedule", "microbatches", "actions", "total_s"]))
    print()
    print(_table(report["scale"], scale_columns))
    if with_torch:
        print()
        print(_table(report["torch_compile"], ["torch_class", "pp", "microbatches", "construct_s",
                                               "lower_s", "total_s", "pp_core_total_s",
                                               "speedup", "note"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
