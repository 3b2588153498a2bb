"""``pp-core schedule show|simulate|export``: look at a schedule before spending a GPU on it.

Each sub-command imports the parts of the schedule half it uses inside its function, so that
``pp-core --help`` and every other command, which import this module to build the parser, do
not pay for them. Nothing here imports torch (``tests/schedule/test_schedule_torch_free.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pp_core.app.commands.schedule_file import fill_from_pipeline_file
from pp_core.app.output_paths import pipeline_reads, refuse_collisions
from pp_core.errors import PPCoreError, ScheduleError
from pp_core.schedule.buffer_plan import recv_buffer_report
from pp_core.schedule.build import build_schedule
from pp_core.schedule.csv_io import format_comms_csv, format_csv, installed_torch_version, \
    read_csv
from pp_core.schedule.frozen import backward_from, frozen_costs, without_frozen
from pp_core.schedule.limits import size_problem
from pp_core.schedule.lower import lower
from pp_core.schedule.render import caption, render_svg, render_text
from pp_core.schedule.simulate import Costs, simulate
from pp_core.schedule.torch_comms import dialect_of, release_dialect
from pp_core.schedule.trace import chrome_trace

HELP = """\
Build a pipeline schedule (a registered name or a torch-format CSV), check it
(placement, completeness, deadlock freedom), then:

  show      draw its timeline in the terminal (and as an SVG with -o FILE.svg)
  simulate  report makespan, bubble ratio and peak in-flight activations per rank
  export    write it as a CSV that torch's _load_csv (and pp-core) read: compute-only,
            or with --format compute_comms the whole lowered program in the dialect of
            the installed torch (or --torch VERSION): 2.15 adds WAIT_SEND_F/_B and
            WAIT_REDUCE_GRAD, which 2.13 and 2.14 cannot read

Times are per action (default F=1, B=2, I=1, W=1, no communication cost);
peak activations count (stage, microbatch) pairs whose F has started and whose
B (or W) has not finished.
"""

EXAMPLES = """\
examples:
  pp-core schedule show 1f1b --pp 4 --microbatches 8
  pp-core schedule show zero_bubble --pp 4 --microbatches 8 -o zb.svg
  pp-core schedule show interleaved_1f1b --pp 4 --microbatches 8 --stages-per-rank 3
  pp-core schedule simulate v_schedule --pp 8 --microbatches 32 --json
  pp-core schedule simulate zero_bubble --pp 4 --microbatches 16 --cost-i 1.2 --cost-w 0.8
  pp-core schedule simulate 1f1b --pp 4 --microbatches 8 --trace 1f1b.json   (ui.perfetto.dev)
  pp-core schedule export Interleaved1F1B --pp 4 --microbatches 8 -o order.csv
  pp-core schedule export zero_bubble --pp 4 -m 8 --format compute_comms --torch 2.15 -o zb.csv
  pp-core schedule simulate --csv order.csv --json
  pp-core schedule show examples/demo.yaml      (the pipeline file's schedule and sizes)
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "schedule", help="show, simulate or export a pipeline schedule",
        description=HELP, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="schedule_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: _usage(parser))
    specs = {
        "show": ("draw the timeline (text; SVG with -o)",
                 "Print the schedule's timeline, one row per rank ('.' idle, '~' continuation), "
                 "and its figures. With -o FILE, also write an SVG picture."),
        "simulate": ("makespan, bubble ratio, peak activations per rank",
                     "Simulate the schedule and report its figures as a table, or as JSON with "
                     "--json. --trace FILE writes a Chrome/Perfetto trace of the timeline."),
        "export": ("write the CSV torch's _load_csv reads (compute-only or compute_comms)",
                   "Write the schedule as torch's CSV (one row per rank) to -o FILE, or to "
                   "stdout: compute-only, or with --format compute_comms the lowered program "
                   "(sends, receives, FSDP unshard/reshard, gradient reduction; torch 2.15's "
                   "waits when the dialect is 2.15) that _PipelineScheduleRuntime."
                   "_load_csv(FILE, format='compute_comms') runs as it is."),
    }
    for name, (short, long) in specs.items():
        sub = actions.add_parser(name, help=short, description=long, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(sub)
        if name == "show":
            sub.add_argument("-o", "--output", metavar="FILE", help="also write an SVG picture")
        elif name == "simulate":
            sub.add_argument("-o", "--output", metavar="FILE", help="write the JSON figures here")
            sub.add_argument("--trace", metavar="FILE",
                             help="write a Chrome/Perfetto trace (JSON) of the timeline")
            sub.add_argument("--timeline", action="store_true",
                             help="include every action's start and end in the JSON")
            sub.add_argument("--pool-slack", type=int, default=2, metavar="N",
                             help="spare sets of the receive-buffer pool in the JSON's "
                                  "recv_buffers figures (default 2)")
            sub.add_argument("--recv-bytes", type=_amount(int, maximum=MAX_BYTES), metavar="N",
                             help="bytes of one received message; adds receive-buffer bytes "
                                  "with and without the pool to recv_buffers")
        else:
            sub.add_argument("-o", "--output", metavar="FILE", help="CSV file (default: stdout)")
            sub.add_argument("--format", choices=("compute_only", "compute_comms"),
                             default="compute_only",
                             help="torch's CSV formats: F/B/I/W only (default), or the lowered "
                                  "program with its communication")
            sub.add_argument("--torch", metavar="VERSION", dest="torch_version",
                             help="the torch release that will load a compute_comms file "
                                  "(its dialect: 2.15 and later write waits, 2.13 and 2.14 "
                                  "do not); default: the installed torch's, else 2.15")
        sub.set_defaults(func=globals()[f"_{name}"])


MAX_AMOUNT = 1e12
"""Largest time or processor count the commands take: a makespan of a million actions of this
cost stays finite (``--cost-f 1e308`` gave makespan inf and bubble nan)."""
MIN_PROCESSORS = 1e-3
"""``--processors 1e-300`` stretched every action by 1e300."""
MAX_BYTES = 2 ** 60


def _amount(kind, positive: bool = False, minimum: float | None = None,
            maximum: float = MAX_AMOUNT):
    """An argparse type for costs, latencies and byte counts: a finite number >= 0 (> 0 with
    ``positive``; ``nan`` would print "makespan nan", ``-5`` negative byte counts), at most
    ``maximum`` (and at least ``minimum``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        word = "an int" if kind is int else "a finite number"
        if value is None or not math.isfinite(value) or value < 0 or \
                (positive and value == 0) or (minimum is not None and value < minimum):
            low = f">= {minimum:g}" if minimum is not None else ("> 0" if positive else ">= 0")
            raise argparse.ArgumentTypeError(f"expected {word} {low}, found {text[:40]!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is more than the limit {maximum:g}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _add_common(sub) -> None:
    sub.add_argument("name", nargs="?", metavar="NAME",
                     help="schedule name or alias (see 'pp-core plugins'), e.g. 1f1b; or a "
                          "pipeline file: its schedule, pp, microbatches, stages per rank")
    sub.add_argument("--csv", metavar="FILE", help="read the schedule from a CSV instead of NAME")
    sub.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    sub.add_argument("--microbatches", "-m", type=int, metavar="M", help="microbatches per step")
    sub.add_argument("--stages-per-rank", "-v", type=int, metavar="V",
                     help="stages per rank (default: the schedule's own)")
    sub.add_argument("--seq-chunks", "-k", type=int, metavar="K",
                     help="cut each microbatch into K sequence slices scheduled as units "
                          "(pipeline.pp_seq_chunks; default 1); figures stay in microbatches")
    for kind, default in (("f", 1.0), ("b", 2.0), ("i", 1.0), ("w", 1.0)):
        sub.add_argument(f"--cost-{kind}", type=_amount(float, positive=True), default=default, metavar="X",
                         help=f"time of one {kind.upper()} action (default {default:g})")
    sub.add_argument("--comm-latency", type=_amount(float), default=0.0, metavar="X",
                     help="added to every hand-off between different ranks (default 0)")
    sub.add_argument("--processors", type=_amount(float, minimum=MIN_PROCESSORS), metavar="P",
                     help="the ranks share P processors (CPU ranks on fewer cores than ranks); "
                          "default: one per rank")
    sub.add_argument("--activation-bytes", type=_amount(float, maximum=MAX_BYTES), metavar="N",
                     help="bytes one stage keeps per microbatch; adds peak bytes per rank")
    sub.add_argument("--frozen", metavar="STAGES",
                     help="stages with nothing to train, e.g. 0,1 (LoRA, model.freeze): their W "
                          "costs 0 and B = I, and the stages before the first trainable one run "
                          "no backward (pp_core.schedule.frozen)")
    sub.add_argument("--json", action="store_true", help="print JSON instead of text")


def _usage(parser) -> int:
    parser.print_help()
    return 2


FLAGS = {"num_ranks": "--pp", "stages_per_rank": "--stages-per-rank",
         "num_microbatches": "--microbatches"}


def _schedule(args):
    pipeline = args.name if args.name and args.name.endswith((".yaml", ".yml")) else None
    refuse_collisions({"--csv": args.csv},
                      {"-o": args.output, "--trace": getattr(args, "trace", None)},
                      pipeline_reads(pipeline) if pipeline else ())
    if args.pp is not None and args.microbatches is not None:
        too_large = size_problem(args.pp, args.stages_per_rank, args.microbatches, FLAGS)
        if too_large is not None:
            raise ScheduleError(too_large)

    if args.name and args.name.endswith((".yaml", ".yml")):
        fill_from_pipeline_file(args)
    if args.csv and args.name:
        raise ScheduleError(f"give a schedule NAME or --csv FILE, not both (got {args.name!r} "
                            f"and --csv {args.csv!r})")
    chunks = 1 if args.seq_chunks is None else args.seq_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"--seq-chunks {chunks!r}: the slices per microbatch must be an int "
                            f">= 1")
    if args.csv and chunks > 1:
        raise ScheduleError(f"--seq-chunks {chunks} cannot take --csv {args.csv!r}: a CSV orders "
                            f"whole microbatches (torch's have no slices); name a schedule")
    if args.csv:
        schedule = read_csv(args.csv, format="auto")
        if args.pp is not None or args.microbatches is not None or args.stages_per_rank:
            build_schedule(csv_path=args.csv,
                           num_ranks=args.pp if args.pp is not None else schedule.num_ranks,
                           num_microbatches=args.microbatches if args.microbatches is not None
                           else schedule.num_microbatches,
                           stages_per_rank=args.stages_per_rank)
        return schedule
    if not args.name:
        raise ScheduleError("name a schedule (e.g. 'pp-core schedule show 1f1b --pp 4 "
                            "--microbatches 8') or pass --csv FILE; 'pp-core plugins' lists them")
    missing = [flag for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches))
               if value is None]
    if missing:
        raise ScheduleError(f"schedule {args.name!r} needs {' and '.join(missing)} "
                            f"(e.g. --pp 4 --microbatches 8)")
    return build_schedule(args.name, num_ranks=args.pp, num_microbatches=args.microbatches,
                          stages_per_rank=args.stages_per_rank, seq_chunks=chunks)


def _simulated(args):
    costs = Costs(F=args.cost_f, B=args.cost_b, I=args.cost_i, W=args.cost_w)
    schedule = _schedule(args)
    if getattr(args, "frozen", None):
        costs = frozen_costs(costs, schedule.num_stages, _trainable(args.frozen,
                                                                    schedule.num_stages))
    return simulate(schedule, costs, comm_latency=args.comm_latency,
                    activation_bytes=args.activation_bytes, processors=args.processors)


def _trainable(text: str, num_stages: int) -> tuple[bool, ...]:
    """``--frozen 0,1``: per stage, whether it trains."""
    try:
        frozen = {int(piece) for piece in text.split(",") if piece.strip()}
    except ValueError:
        frozen = None
    if not frozen or not all(0 <= s < num_stages for s in frozen):
        raise ScheduleError(f"--frozen {text[:40]!r}: expected stage indices 0..{num_stages - 1}"
                            f" separated by commas, e.g. --frozen 0,1")
    return tuple(s not in frozen for s in range(num_stages))


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    except OSError as exc:
        raise PPCoreError(f"cannot write {path!r}: {exc.strerror or exc}") from None


def _show(args) -> int:
    result = _simulated(args)
    timeline = render_text(result)  # refuses a timeline too large to draw before writing files
    if args.output:
        _write(args.output, render_svg(result))
    if args.json:
        figures = result.to_dict()
        figures["rows"] = result.schedule.rows()
        figures["timeline_text"] = timeline.splitlines()
        print(json.dumps(figures, indent=2))
        return 0
    print(caption(result))
    print(timeline)
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _simulate(args) -> int:
    if args.pool_slack < 0:  # checked here too: the text table skips the receive-buffer figures
        raise ScheduleError(f"--pool-slack: slack={args.pool_slack} must be an int >= 0 (spare "
                            f"receive-buffer sets per stage and direction)")
    result = _simulated(args)
    figures = result.to_dict(timeline=args.timeline)
    if args.json or args.output:  # the text table does not show them; lowering every rank costs
        figures["recv_buffers"] = _recv_buffers(result.schedule, args)
    if args.trace:
        _write(args.trace, json.dumps(chrome_trace(result)))
    if args.output:
        _write(args.output, json.dumps(figures, indent=2) + "\n")
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0

    print(caption(result))
    print(f"{'rank':>4}  {'stages':<12} {'busy':>8} {'idle':>8} {'peak act.':>9}"
          + ("  peak bytes" if result.peak_activation_bytes is not None else ""))
    schedule = result.schedule
    for rank in range(schedule.num_ranks):
        stages = ",".join(map(str, schedule.stages_of(rank)))
        line = (f"{rank:>4}  {stages:<12} {figures['busy'][rank]:>8} {figures['idle'][rank]:>8} "
                f"{figures['peak_activations'][rank]:>9}")
        if result.peak_activation_bytes is not None:
            line += f"  {figures['peak_activation_bytes'][rank]:>10}"
        print(line)
    for path, what in ((args.trace, "trace"), (args.output, "figures")):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def _recv_buffers(schedule, args) -> dict:
    """Receive-buffer sets (and bytes) per rank, stage and direction, with and without the pool."""
    return recv_buffer_report(lower(schedule), slack=args.pool_slack,
                              bytes_per_set=args.recv_bytes)


def _export(args) -> int:
    named = None if args.torch_version is None else release_dialect(args.torch_version)
    schedule = _schedule(args)
    if schedule.seq_chunks > 1:
        raise ScheduleError(f"--seq-chunks {schedule.seq_chunks}: a CSV (torch's format) orders "
                            f"whole microbatches and has no slices; export with --seq-chunks 1, "
                            f"or look at the sliced order with 'pp-core schedule show'")
    trainable = _trainable(args.frozen, schedule.num_stages) if args.frozen else None
    schedule = without_frozen(schedule, trainable)  # the program a LoRA run executes
    dialect = None
    if args.format == "compute_comms":
        dialect = named or dialect_of(installed_torch_version())
        text = format_comms_csv(schedule, dialect,
                                backward_from(trainable) if trainable is not None else 0)
    elif args.torch_version is not None:
        raise ScheduleError("--torch chooses the dialect of a compute_comms file; add --format "
                            "compute_comms (a compute-only CSV reads the same in every torch)")
    else:
        text = format_csv(schedule)
    if args.output:
        _write(args.output, text)
        stages = f", {schedule.num_stages} stages" if schedule.num_stages != schedule.num_ranks \
            else ""
        what = f", compute_comms for torch {dialect}+" if dialect == "2.15" else \
            ", compute_comms for torch 2.13-2.14" if dialect else ""
        print(f"wrote {args.output}: {schedule.name}, pp={schedule.num_ranks}{stages}, "
              f"microbatches={schedule.num_microbatches} ({schedule.num_ranks} rows, one per "
              f"rank{what})")
    else:
        sys.stdout.write(text)
    return 0
