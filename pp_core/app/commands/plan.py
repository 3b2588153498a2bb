"""``pp-core plan FILE.yaml``: profile the pipeline's model and rank every plan that fits."""

from __future__ import annotations

import argparse
import json
import sys

HELP = """\
Measure the pipeline's model on its configured device (built for real, with
one batch of its data), then rank every installed schedule x stages per rank x
microbatch size (divisors of pp_batch_size) x cost-balanced split by the step
time the simulator predicts from those measurements, and drop the plans whose
predicted peak memory on some rank exceeds --memory-cap. With
'train.activation_checkpointing: auto' the planner also chooses, with the
split, which stages recompute (none / selective / full per stage) to fit the
cap; a mode written there is kept on every stage.

This is what 'pipeline.pp_schedule: auto' runs before 'pp-core run' starts
the ranks; the file's pp_schedule may be auto or any schedule (it is not used).
Like validate, plan imports and calls the code the file names.
"""

EXAMPLES = """\
examples:
  pp-core plan examples/demo.yaml
  pp-core plan examples/demo.yaml --memory-cap 512MiB
  pp-core plan pipe.yaml --memory-cap 8GiB --json > plan.json
  pp-core plan pipe.yaml --memory-cap 8GiB -o chosen.yaml && pp-core run chosen.yaml
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="profile the model and rank the pipeline plans that fit memory",
        description=HELP, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", metavar="PIPELINE.yaml")
    parser.add_argument("--memory-cap", metavar="SIZE",
                        help="most memory a rank may use, e.g. 512MiB or 8GiB (default: no cap)")
    parser.add_argument("--top", type=_positive, default=8, metavar="N",
                        help="plans shown in the table (default 8)")
    parser.add_argument("--json", action="store_true", help="print the whole ranking as JSON")
    parser.add_argument("--no-link", action="store_true",
                        help="do not start processes to time the link between ranks, the "
                             "collectives or (with --world) a running pipeline (transfers and "
                             "collectives are then free in the prediction)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the chosen layout as a YAML pipeline that 'pp-core run' "
                             "runs as it stands (schedule, split, microbatch size, activation "
                             "checkpointing per stage, degrees)")
    parser.add_argument("--world", type=_int, metavar="N",
                        help="rank every pp x dp_replicate x dp_shard x tp (x ep) layout of N "
                             "processes the model admits, each with its best plan (as "
                             "distributed: {world_size: N, layout: auto}); a degree given with "
                             "--set distributed.KEY=V stays fixed")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY.PATH=VALUE", help="override a key (as for run)")
    parser.set_defaults(func=plan_command)


def _positive(text: str) -> int:
    """``--top``: an int >= 1 (``--top 0`` would show no plan at all)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, found {text[:40]!r}")
    return value


def _int(text: str) -> int:
    """``--world``: an int (its range is checked with the layouts, in one message)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, found "
                                         f"{text[:40]!r}") from None


def plan_command(args) -> int:
    from pp_core.app.launch.decide import as_auto, plan_spec  # lazy: only when `pp-core plan` runs
    from pp_core.planning.report import format_ranking
    from pp_core.planning.sizes import parse_size
    from pp_core.app.check import preflight
    from pp_core.app.spec import load_spec

    cap = None if args.memory_cap is None else parse_size(args.memory_cap)
    spec = as_auto(load_spec(args.pipeline, args.overrides))
    world = _world(args, spec)
    if world is not None:
        return _plan_world(args, spec, world, cap)
    preflight(spec, run_checks=False)  # names, arguments, batch sizes: fail before profiling
    plan = plan_spec(spec, memory_cap=cap, measure_link=not args.no_link)
    if args.output is not None:
        _write(spec, plan, args.output)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    dims = spec.dims
    print(f"{spec.source}: pp {dims.pp}" + (f", tp {dims.tp}" if dims.tp > 1 else "") +
          f", pp_batch_size "
          f"{spec.pipeline.pp_batch_size}; profiled in {plan.profile_s:.1f} s" +
          ("" if plan.link is None else f", link {plan.link.latency_s * 1e6:.0f} us + "
                                        f"{plan.link.bytes_per_s / 1e9:.2f} GB/s") +
          ("" if plan.processors is None else
           f"; the ranks share {plan.processors:g} processors' worth of cores"))
    print(format_ranking(plan.ranking, top=args.top))
    if plan.ranking.kept:
        stages = plan.chosen.fqns_per_stage
        print("split: " + " | ".join(", ".join(s) for s in stages))
    return 0


def _world(args, spec) -> int | None:
    """The world the layouts are searched for: ``--world``, or the file's ``world_size`` with
    ``layout: auto``; ``None``: plan the file's own degrees."""
    from pp_core.errors import ConfigError  # lazy: as plan_command's imports

    dist = spec.distributed
    written = dist.world_size if dist.layout == "auto" else None
    if args.world is not None and written is not None and args.world != written:
        raise ConfigError(f"--world {args.world} contradicts distributed.world_size: {written} "
                          f"of {spec.source}; give one of them")
    return args.world if args.world is not None else written


DEGREE_OVERRIDES = ("pp_size", "dp_replicate", "dp_shard", "tp_size", "ep_size")


def _plan_world(args, spec, world: int, cap) -> int:
    """``--world N``: rank the layouts (:mod:`pp_core.app.plan.plan_world`)."""
    from pp_core.app.plan.plan_world import format_world, plan_world  # lazy: torch, the planner
    from pp_core.app.spec import parse_override  # lazy: as plan_command's imports

    fixed = {}
    for text in args.overrides:
        path, value = parse_override(text)
        if path[:1] == ["distributed"] and path[-1] in DEGREE_OVERRIDES:
            fixed[path[-1]] = value
    found = plan_world(spec, world, memory_cap=cap, measure_link=not args.no_link,
                       fixed=fixed, say=_progress)
    if args.output is not None:
        chosen = found.chosen_layout
        _write(chosen.spec, chosen.plan, args.output)
    if args.json:
        print(json.dumps(found.to_dict(), indent=1))
        return 0
    print(format_world(found, top=args.top))
    return 0


def _progress(line: str) -> None:
    """What ``--world`` is measuring, on stderr (a minute or more; stdout keeps the result)."""
    print(line, file=sys.stderr, flush=True)


def _write(spec, plan, path: str) -> None:
    """``-o FILE``: the chosen layout as a runnable YAML pipeline."""
    import yaml  # lazy: only with -o

    from pp_core.app.launch.decide import written_spec  # lazy: as plan_command's imports

    import os  # lazy: as above

    from pp_core.errors import ConfigError

    if os.path.exists(path) and os.path.samefile(path, spec.source):
        raise ConfigError(f"-o {path}: that is the pipeline being planned; write the chosen "
                          f"layout to another file")
    values = written_spec(spec, plan)
    with open(path, "w") as fh:
        fh.write(f"# written by 'pp-core plan {spec.source}': the chosen plan, no auto left\n")
        yaml.safe_dump(values, fh, sort_keys=False)
