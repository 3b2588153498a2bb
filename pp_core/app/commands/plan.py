"""``pp-core plan FILE.yaml``: profile the pipeline's model and rank every plan that fits."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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
    from pp_core.app.output_paths import refuse_output, run_paths
    from pp_core.app.spec import load_spec

    cap = None if args.memory_cap is None else parse_size(args.memory_cap)
    spec = as_auto(load_spec(args.pipeline, args.overrides))
    if args.output is not None:  # before any measuring: not an input of the run, writable
        refuse_output("-o", args.output, run_paths(spec))
    world = _world(args, spec)
    if world is not None:
        return _plan_world(args, spec, world, cap)
    preflight(spec, run_checks=False)  # names, arguments, batch sizes: fail before profiling
    plan = plan_spec(spec, memory_cap=cap, measure_link=not args.no_link)
    if args.output is not None:
        _write(spec, plan, args.output, _progress)
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


def _plan_world(args, spec, world: int, cap) -> int:
    """``--world N``: rank the layouts (:mod:`pp_core.app.plan.plan_world`)."""
    from pp_core.app.plan.plan_world import format_world, plan_world  # lazy: torch, the planner
    from pp_core.app.spec import parse_override  # lazy: as plan_command's imports
    from pp_core.parallel.dims import ParallelDims  # lazy: as plan_command's imports

    fixed = {}
    for text in args.overrides:
        path, value = parse_override(text)
        if path[:1] == ["distributed"] and path[-1] in ParallelDims.KEYS.values():
            fixed[path[-1]] = value
    found = plan_world(spec, world, memory_cap=cap, measure_link=not args.no_link,
                       fixed=fixed, say=_progress)
    chosen = found.chosen_layout  # none under the cap: exit 1 and write nothing, say why
    if args.output is not None:
        _write(chosen.spec, chosen.plan, args.output, _progress)
    if args.json:
        print(json.dumps(found.to_dict(), indent=1))
        return 0
    print(format_world(found, top=args.top))
    return 0


def _progress(line: str) -> None:
    """What ``--world`` is measuring, on stderr (a minute or more; stdout keeps the result)."""
    print(line, file=sys.stderr, flush=True)


def _write(spec, plan, path: str, say) -> None:
    """``-o FILE``: the chosen layout as a runnable YAML pipeline (:func:`written_file`); ``say``
    names the file."""
    import yaml  # lazy: only with -o

    from pp_core.app.launch.decide import written_spec  # lazy: as plan_command's imports

    values, moved = written_file(spec, written_spec(spec, plan), path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"# written by 'pp-core plan {spec.source}': the chosen plan, no auto left; "
                 f"only what differs from the defaults\n")
        yaml.safe_dump(values, fh, sort_keys=False)
    away = f"; {', '.join(moved)} moved into a {Path(path).stem!r} folder beside the source " \
           f"run's, which it leaves alone" if moved else ""
    say(f"wrote {path}: the chosen plan, paths from its folder, what differs from the "
        f"defaults{away}")


OUTPUT_KEYS = (("checkpoint", "dir"), ("checkpoint", "export_hf"), ("output", "metrics"),
               ("output", "trace"), ("output", "schedule_image"), ("output", "tensorboard"))
"""What a run writes: ``plan -o`` points these away from the source run's."""
READ_KEYS = (("data", "args"), ("data", "eval_args"), ("model", "args"),
             ("pipeline", "pp_schedule_csv"), ("checkpoint", "resume"))
"""Where a run's inputs are named: relative paths are rewritten for the written file's folder."""


def written_file(spec, values: dict, path: str) -> tuple[dict, list[str]]:
    """What ``plan -o PATH`` writes of ``values`` (the planned spec, every key): only what differs
    from the defaults; each path the source file reads written relative to PATH's folder (a
    pipeline file's relative paths are relative to its folder); each output moved into a folder
    named after PATH beside the source run's (``runs/ckpt`` -> ``runs/chosen/ckpt``), so running
    it replaces nothing of that run. Returns the values and the output keys moved."""
    from pp_core.app.spec.schema import SCHEMA  # lazy: as plan_command's imports

    out = {}
    for section, keys in values.items():
        defaults = {key.name: _normal(key) for key in SCHEMA.get(section, [])}
        changed = {name: value for name, value in keys.items()
                   if name not in defaults or value != defaults[name] or
                   (section, name) == ("distributed", "pp_size")}  # the plan's first degree
        if changed or section in ("model", "data"):
            out[section] = changed
    source, target = Path(spec.source).resolve().parent, Path(path).resolve().parent
    for section, key in READ_KEYS:
        if key in out.get(section, {}):
            out[section][key] = _relocated(out[section][key], source, target)
    moved = []
    for section, key in OUTPUT_KEYS:
        value = out.get(section, {}).get(key)
        written = value.get("dir") if isinstance(value, dict) else value
        if isinstance(written, str) and written:
            beside = _from(target, source / Path(written).parent / Path(path).stem
                           / Path(written).name)
            extra = {k: v for k, v in value.items() if k != "dir" and v is not None} \
                if isinstance(value, dict) else {}
            out[section][key] = {"dir": beside, **extra} if extra else beside
            moved.append(f"{section}.{key}")
    return out, moved


def _normal(key):
    """A schema key's default as the spec holds it once checked (``none`` -> ``{mode: none}``)."""
    try:
        return key.check(key.default) if key.default is not None else None
    except Exception:  # noqa: BLE001 - a default its own checker does not take as it is
        return key.default


def _from(target: Path, path: Path) -> str:
    """``path`` as the pipeline file in ``target`` names it: relative to that folder."""
    return os.path.relpath(path, target)


def _relocated(value, source: Path, target: Path):
    """``value`` with each path inside the source file's folder (the spec made every relative
    path absolute against it) rewritten relative to ``target``; other values as they are."""
    if isinstance(value, dict):
        return {k: _relocated(v, source, target) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocated(v, source, target) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and Path(value).is_relative_to(source):
        return _from(target, Path(value))
    return value
