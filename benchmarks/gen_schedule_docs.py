"""Regenerate docs/schedules.md: the guide, the gallery (pp=4, m=8) and the benchmark figures.

    python benchmarks/bench_schedules.py --json benchmarks/results/bench_schedules.json
    python benchmarks/gen_schedule_docs.py            # writes docs/schedules.md

The gallery is computed here (every installed built-in schedule, simulated at unit costs); the
benchmark section is read from the JSON the benchmark wrote, when it exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pp_core.errors import PPCoreError
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import build_schedule, resolve_schedule_def
from pp_core.schedule.render import render_text
from pp_core.schedule.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_schedules.json"
OUT = ROOT / "docs" / "schedules.md"

GUIDE = """\
# Schedules: build, check, simulate, draw, export

A pipeline schedule in pp-core is data: one list of compute actions per rank plus the rank of
every stage (`pp_core.Schedule`). Actions are written like torch's: `2F0` is the forward of
microbatch 0 through stage 2, `B` a full backward, `I` the input-gradient half and `W` the
weight-gradient half of a split backward. Schedules come from plugins (the built-ins below, or
your own `pp_register_schedules`) or from a torch-format CSV file; everything on this page is
pure Python (no torch, no process group) and linear in the number of actions.

```python
from pp_core.schedule import build_schedule, simulate, read_csv, write_csv
from pp_core.schedule.render import render_text, render_svg

schedule = build_schedule("zero_bubble", num_ranks=4, num_microbatches=8)  # validated
result = simulate(schedule)            # Costs(F=1, B=2, I=1, W=1), comm_latency=0
print(result.makespan, result.bubble_ratio, result.peak_activations)
print(render_text(result))
write_csv(schedule, "zb.csv")          # torch's _load_csv reads it
same = read_csv("zb.csv")              # placement inferred from the rows, re-validated
```

```
pp-core schedule show zero_bubble --pp 4 --microbatches 8 [-o zb.svg]
pp-core schedule simulate v_schedule --pp 8 --microbatches 32 --json [--trace t.json]
pp-core schedule export interleaved_1f1b --pp 4 --microbatches 8 -o order.csv
pp-core schedule simulate --csv order.csv --cost-i 1.2 --cost-w 0.8
```

## Building: `build_schedule`

`build_schedule(name=None, *, num_ranks, num_microbatches, stages_per_rank=None, csv_path=None,
plugins=None)` looks the name (or alias, case-insensitive) up in the plugins, places stages with
the schedule's placement (`loop`: stage `s` on rank `s % p`; `v`: rank `r` holds `r` and
`2p-1-r`), calls the generator, and validates the result. `stages_per_rank` defaults to the
schedule's own; only schedules registered with `variable_stages_per_rank=True` accept another
value. With `csv_path` the name is ignored (as torchtitan ignores the schedule name when a CSV is
given) and the file's rank count and microbatch count must match. Every failure is a
`ScheduleError` that says what to change.

## Validation: `validate_schedule`

A schedule is rejected, with the rank, the step (position in that rank's list, idle cells
counted: the CSV column) and the action, when

* a stage's actions are on more than one rank, or a stage/microbatch index is out of range;
* a `(stage, microbatch)` lacks its `F`, or lacks a backward (one `B`, or one `I` followed later
  by one `W`), or has a duplicate;
* the local order is wrong: `F` before `I`/`B`, `I` before `W`, no `W` after a full `B`;
* it holds a communication action (lowering adds those);
* it would **deadlock**. Validation list-schedules the ranks (each runs its next action as soon
  as its input exists: `F(s,k)` needs `F(s-1,k)`, `I/B(s,k)` needs `I/B(s+1,k)`, never a `W`)
  and, when no rank can move, explains the cycle and prints the grid with the stuck steps
  bracketed:

```
schedule 't' deadlocks at rank 0 step 1 (0B0): no rank can make progress
  rank 0 step 1: 0B0 waits for 1B0 at rank 1 step 2,
  which comes after 1F1 at rank 1 step 1,
  which waits for 0F1 at rank 0 step 2,
  which comes after 0B0 at rank 0 step 1,
  which closes the cycle (back at rank 0 step 1).
Reorder the actions so every F(s,k) comes after F(s-1,k) and every I/B(s,k) after I/B(s+1,k) \
can have finished.
grid (steps 0..3 shown; blocked/bad actions in [brackets]):
step     0     1     2     3
rank 0  0F0  [0B0]  0F1   0B1
rank 1  1F0  [1F1]  1B0   1B1
```

## Simulation: `simulate`

`simulate(schedule, costs=Costs(F=1, B=2, I=1, W=1, per_stage={...}), comm_latency=0.0,
activation_bytes=None)` replays the schedule: each rank runs its actions in order, an action
starts at `max(rank free, input ready + comm_latency)` (a hand-off between two stages on the same
rank is free). It reports, per rank and overall:

* **makespan**; **bubble** = max over ranks of (makespan − busy), **bubble ratio** = bubble /
  makespan (the figure `pp-core schedule simulate` prints);
* **span bubble** = max over ranks of (last end − first start − busy): the zero-bubble papers'
  figure, which ignores the staggered start (ZB-V's span bubble is 0 at equal F/I/W costs);
* **peak in-flight activations** per rank: the most `(stage, microbatch)` pairs whose `F` has
  started and whose `B` (or `W`) has not finished — one unit is one stage's activations for one
  microbatch, so looped schedules count `v` units for a full model slice; in bytes too with
  `activation_bytes` (one number, or one per stage).

With `processors=P` (`--processors P`) the ranks share `P` processors, as one-thread CPU ranks
on a machine with fewer cores than ranks do: while `n` ranks have an action running each goes at
`min(1, P / n)` of full speed, a rank waiting for a hand-off takes none (processor sharing,
`pp_core.schedule.sharing`); 1F1B at pp=4, m=8 takes 33 on four processors and 51 on two
(its 96 units of work over 2, plus the fill). The planner uses it for CPU ranks that share cores.

`SimResult.to_dict()` is JSON; `pp_core.schedule.trace.write_chrome_trace(result, path)` writes a
Chrome/Perfetto trace (one thread per rank). DualPipeV's `OVERLAP_F_B` pairs are two actions in
the IR, run one after the other, each waiting only for its own input — what torch's runtime does
when no overlap function is registered.

## Your own schedule

A schedule plugin registers a `ScheduleDef` whose generator returns one action list per rank;
`build_schedule` does the placement, the size checks and the validation, so the generator only
orders actions (raise `ScheduleError` for sizes it cannot do):

```python
from pp_core import Action, B, F, ScheduleDef, ScheduleError, hookimpl

def reverse_gpipe(num_stages, num_microbatches, num_ranks):
    # GPipe with backwards in decreasing microbatch order (frees the newest activations first)
    mbs = range(num_microbatches)
    return [[Action(r, F, k) for k in mbs] + [Action(r, B, k) for k in reversed(mbs)]
            for r in range(num_ranks)]

@hookimpl
def pp_register_schedules(register):
    register("reverse_gpipe", ScheduleDef(reverse_gpipe, description="GPipe, LIFO backwards"))
```

`ScheduleDef` also carries `aliases`, `placement` (`"loop"`, `"v"`, or a callable
`(num_stages, num_ranks) -> rank per stage`), `stages_per_rank` and
`variable_stages_per_rank`. See `docs/plugins.md` for packaging.

## CSV files

The format of torch's `_PipelineScheduleRuntime._load_csv(format="compute_only")` (2.13 to
2.15): one row per rank, cells `<stage><F|B|I|W><mb>`, an empty cell an idle step, written with
`csv.writer` defaults (CRLF). `read_csv` also reads torch's default `compute_comms` dumps and
DualPipeV's `(a;b)OVERLAP_F_B` cells (split into `a` then `b`). Cells are parsed strictly
(`0F1junk` is an error, which torch would read as `0F1`), and errors name the row (rank), the
column and the reason. The stage placement is inferred from the row each stage appears in.

A `compute_comms` file's other cells keep torch's meaning and are checked before they are
dropped (pp-core's lowering re-derives its own communication): `SEND_F/RECV_F/SEND_B/RECV_B`
(each on its own stage's row, a send after the compute that produced it, a receive before its
consumer, every hand-off between ranks with both), `UNSHARD/RESHARD` (FSDP: alternating, every
compute of the stage between them), `REDUCE_GRAD` (after the stage's last backward) and torch
2.15's waits: `WAIT_SEND_F/WAIT_SEND_B` (one per send, after it: 2.15's runtime retires a send
only there) and `WAIT_REDUCE_GRAD` (one per reduction, at most one pending per rank). A file with
any wait is held to 2.15's rules, one without to 2.13-2.14's, which have no waits. Finally the
rows are run as torch's runtime would (a compute fed from another rank waits for the peer's send,
a send's wait for the peer's receive): a file that would hang is refused with each blocked cell
and what it waits for.

`pp-core schedule export NAME ... --format compute_comms` writes the whole program (pp-core's
send/receive order, torch's UNSHARD/RESHARD and REDUCE_GRAD, and in 2.15's dialect the waits where
torch 2.15's own lowering puts them) for `_load_csv(path, format="compute_comms")`. The dialect is
the installed torch's (read from its metadata, torch is not imported), or `--torch VERSION`: a
2.15 file cannot be read by 2.13-2.14, whose parser takes `0WAIT_SEND_F0` for `0W`, and 2.15
refuses a file without waits. tests/runtime/test_torch_runtime_csv.py runs every built-in schedule's
export in torch's runtime, and every torch class's dump in pp-core, against one process (2.13 and
2.15: all pass).
"""


def gallery() -> str:
    plugins = default_plugins()
    parts = ["## Gallery (pp=4, 8 microbatches, unit costs)\n",
             "Timelines: one column per time unit, `.` idle, `~` the second slot of a `B`. "
             "Peak = in-flight (stage, microbatch) pairs per rank.\n"]
    for entry in plugins.schedules:
        sdef = resolve_schedule_def(entry.name, plugins)[1]
        try:
            schedule = build_schedule(entry.name, num_ranks=4, num_microbatches=8)
        except PPCoreError as exc:
            parts.append(f"### {entry.name}\n\nnot buildable at pp=4, m=8: {exc}\n")
            continue
        result = simulate(schedule)
        d = result.to_dict()
        aliases = ", ".join(f"`{a}`" for a in entry.aliases) or "none"
        placement = sdef.placement if isinstance(sdef.placement, str) else "custom"
        description = (sdef.description or "").strip().splitlines()
        parts.append(f"### {entry.name}\n")
        if description:
            parts.append(description[0] + "\n")
        parts.append(
            f"Aliases: {aliases}. Placement `{placement}`, "
            f"{schedule.num_stages // 4} stage(s) per rank"
            f"{' (variable)' if sdef.variable_stages_per_rank else ''}. "
            f"Makespan {d['makespan']}, bubble {d['bubble']} (ratio {result.bubble_ratio:.3f}), "
            f"span bubble {d['span_bubble']}, peak activations per rank "
            f"{' '.join(map(str, result.peak_activations))}.\n")
        parts.append("```\n" + render_text(result) + "\n```\n")
    return "\n".join(parts)


def benchmark_section() -> str:
    if not RESULTS.exists():
        return ("## Benchmarks\n\nRun `python benchmarks/bench_schedules.py --json "
                f"{RESULTS.relative_to(ROOT)}` and regenerate this page to fill this section.\n")
    report = json.loads(RESULTS.read_text())
    out = ["## Benchmarks\n",
           f"Measured by `benchmarks/bench_schedules.py` (figures in "
           f"`{RESULTS.relative_to(ROOT)}`) on a 2-core CPU machine shared with other jobs, so "
           "timings are indicative.\n",
           "### Bubble ratio: pp-core vs the formula vs torch 2.13\n",
           "Unit costs, default stages per rank. Each cell: pp-core's simulated bubble ratio / "
           "the closed-form formula (`formula` in benchmarks/bench_schedules.py; `~` "
           "approximate) / torch's schedule of "
           "the same name replayed by the same simulator (`=` when torch's order is identical "
           "to pp-core's; `-` torch has no such schedule or refuses the size).\n"]
    rows: dict[tuple[str, int], dict[int, str]] = {}
    formulas: dict[str, str] = {}
    for r in report["bubble"]:
        key = (r["schedule"], r["pp"])
        mult = r["microbatches"] // r["pp"]
        if "bubble_ratio" not in r:
            cell = "n/a"
        else:
            f = r.get("formula_ratio")
            fcell = "" if f is None else (f"{f:.3f}" if r.get("formula_exact") else f"~{f:.3f}")
            if "torch_bubble_ratio" in r:
                tcell = "=" if r.get("same_order") else f"{r['torch_bubble_ratio']:.3f}"
            else:
                tcell = "-"
            cell = f"{r['bubble_ratio']:.3f} / {fcell} / {tcell}"
            formulas[r["schedule"]] = r.get("formula", "")
        rows.setdefault(key, {})[mult] = cell
    out.append("| schedule | formula | pp | m=pp | m=2pp | m=4pp | m=8pp |")
    out.append("|---|---|---|---|---|---|---|")
    for (name, p), cells in rows.items():
        out.append(f"| {name} | {formulas.get(name, '')} | {p} | "
                   + " | ".join(cells.get(k, "") for k in (1, 2, 4, 8)) + " |")
    out.append(
        "\nReading the table. Every torch order pp-core can compare with is identical to "
        "pp-core's (`=`), including the orders torch's GPipe/1F1B runtime loops execute. The "
        "formulas are exact for m >= 2p; below that:\n\n"
        "* `v_schedule` at m = p: the warm-up cannot be filled, so the ratio is above "
        "`(p-1)F` (torch's order gives the same figure);\n"
        "* `dualpipe_v`: the closed-form formula times each `OVERLAP_F_B` pair as one unit that "
        "waits for both inputs; pp-core (like torch's runtime without a registered overlap "
        "function) runs the two halves one after the other, each waiting only for its own "
        "input, which measures a bubble of `(p-1)F` instead of `2(p-1)` (p=4, m=8: 3 vs 6);\n"
        "* `v_half` / `v_min`: the papers give only approximate ratios (about 1/2 and 2/3 of "
        "1F1B's); the measured peaks match their memory bounds (`2*floor((p+2)/2)` and "
        "`2*floor((p+4)/3)` chunk-microbatches).\n")
    notes = sorted({f"{r['schedule']} pp={r['pp']} m={r['microbatches']}: "
                    f"{r.get('note') or r.get('torch_note')}"
                    for r in report["bubble"] if r.get("note") or r.get("torch_note")})
    if notes:
        out.append("\nNotes:\n")
        out.extend(f"* {n}" for n in notes)
    out.append("\n### Compile speed (pp=64, 1024 microbatches)\n")
    out.append("build = generate + validate; validate = one more validation pass alone; lower = "
               "`pp_core.schedule.lower.lower` (SEND/RECV + buffer lifetimes).\n")
    out.append("| schedule | stages/rank | actions | build s | validate s | lower s | total s |")
    out.append("|---|---|---|---|---|---|---|")
    for r in report["compile"]:
        out.append(f"| {r['schedule']} | {r['stages_per_rank']} | {r.get('actions', '')} | "
                   f"{r.get('build_s', '')} | {r.get('validate_s', '')} | {r.get('lower_s', '')} | "
                   f"{r.get('total_s', r.get('note', ''))} |")
    out.append("\nGrowth with the number of microbatches (pp=64, 2 stages per rank; "
               "build + validate + lower, seconds):\n")
    growth: dict[str, dict[int, str]] = {}
    for r in report["growth"]:
        growth.setdefault(r["schedule"], {})[r["microbatches"]] = str(r.get("total_s"))
    out.append("| schedule | m=256 | m=512 | m=1024 |")
    out.append("|---|---|---|---|")
    for name, cells in growth.items():
        out.append(f"| {name} | " + " | ".join(cells.get(m, "") for m in (256, 512, 1024)) + " |")
    if report.get("torch_compile"):
        out.append("\ntorch 2.13, same machine and run: schedule construction + lowering "
                   "(`_prepare_schedule_with_comms`) vs pp-core's build + validate + lower of the "
                   "corresponding schedule:\n")
        out.append("| torch class | pp | m | construct s | lower s | total s | pp-core s | "
                   "torch / pp-core |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in report["torch_compile"]:
            total = r.get("total_s")
            total = f"{total:.2f}" if isinstance(total, float) else r.get("note", "")
            out.append(f"| {r['torch_class']} | {r['pp']} | {r['microbatches']} | "
                       f"{_f(r.get('construct_s'))} | {_f(r.get('lower_s'))} | {total} | "
                       f"{r.get('pp_core_total_s', '')} | {r.get('speedup', '')} |")
    return "\n".join(out) + "\n"


def _f(x) -> str:
    return f"{x:.2f}" if isinstance(x, float) else ""


def main() -> int:
    text = GUIDE + "\n" + gallery() + "\n" + benchmark_section()
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
