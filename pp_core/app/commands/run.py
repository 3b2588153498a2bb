"""``pp-core run FILE``: train a YAML pipeline.

``run`` checks the whole file first as ``validate`` does (unknown keys, types, combinations,
plugin names, the split and the schedule: :func:`~pp_core.app.commands.validate.load_checked`),
so a mistake is reported before any process starts; then it starts ``spec.dims.world_size``
ranks (``pp_size * dp_replicate * dp_shard * tp_size``) through torch's launcher, or runs as one
rank under ``torchrun``.

Every command module is imported to build the parser, so each command imports what it runs
inside its function: ``pp-core schedule ...`` and ``--help`` never pay for the spec machinery or
torch (``tests/schedule/test_schedule_torch_free.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from pp_core.app.commands.validate import SET_HELP, load_checked
from pp_core.app.interrupts import Interrupted, exit_code
from pp_core.config import is_auto
from pp_core.errors import ConfigError

RUN_HELP = """\
Train the pipeline described in a YAML file (see docs/yaml.md).

On one machine pp-core starts pp_size x dp_size processes itself through
torch's launcher API, listening on 127.0.0.1 unless the file names another
address. On several machines run the same command on each one with
distributed.nnodes and a reachable distributed.master_addr/master_port, or let
torchrun start the processes (each then runs as one rank):

  torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 --rdzv-id job1 -m pp_core run pipe.yaml

A YAML 'module:attr' value (model.target, pipeline.loss_fn) imports and runs
that module's code: only run pipeline files you trust.
"""


def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="train a YAML pipeline", description=RUN_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("pipeline", metavar="PIPELINE.yaml", help="the pipeline file")
    run.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY.PATH=VALUE", help=SET_HELP)
    run.add_argument("--memory-cap", metavar="SIZE",
                     help="with pipeline.pp_schedule: auto, the most memory a rank may use "
                          "(e.g. 8GiB); the fastest plan predicted to fit runs")
    run.set_defaults(func=run_command)


def run_command(args) -> int:
    from pp_core.app.launch import launch, started_by_torchrun  # lazy: torch

    from pp_core.planning.sizes import parse_size

    cap = None if args.memory_cap is None else parse_size(args.memory_cap)
    warm: list[bool] = []  # the ranks forked from a fork server importing what they need
    if not started_by_torchrun():  # (pp_core.app.launch.warm) while the file is checked
        from pp_core.app.launch.warm import start  # lazy: only when `pp-core run` launches

        spec, found = load_checked(args, once_read=lambda: warm.append(start()))
    else:
        spec, found = load_checked(args)
    if cap is not None and not is_auto(spec.pipeline.pp_schedule) and \
            spec.distributed.layout != "auto":
        raise ConfigError(f"--memory-cap={args.memory_cap} only steers pipeline.pp_schedule: "
                          f"auto, and the file names {spec.pipeline.pp_schedule!r}; drop "
                          f"--memory-cap or set pp_schedule: auto")
    from torch.distributed.elastic.multiprocessing import SignalException  # lazy: torch

    from pp_core.app.commands.run_lock import run_locks  # lazy: only when a run starts

    try:
        taken: list[str] = []
        with run_locks(spec, taken):  # one writer per checkpoint.dir and output
            # the checks' notes ("m.jsonl exists and will be replaced") once this run holds its
            # outputs: a run another one refuses replaces nothing
            if not started_by_torchrun() or os.environ.get("RANK") == "0":  # not once per rank
                for note in found.notes:
                    print(f"pp-core: note: {note}", flush=True)
            for note in taken:
                print(f"pp-core: note: {note}", flush=True)
            say = lambda line: print(f"pp-core: {line}", flush=True)  # noqa: E731
            dist = spec.distributed
            if dist.layout == "auto" and dist.elastic and not started_by_torchrun():
                from pp_core.app.elastic_layouts import planned_layouts  # lazy: the planner

                spec = planned_layouts(spec, say=say, memory_cap=cap)  # each world's layout
            launch(spec, announce=say, memory_cap=cap, warm=any(warm))
    except (KeyboardInterrupt, SignalException, Interrupted) as exc:
        reason, code = exit_code(exc)
        print(f"\npp-core: interrupted by {reason.name}; the ranks were stopped", file=sys.stderr)
        return code  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    return 0
