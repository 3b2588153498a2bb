"""``pp-core``: the command line. Each sub-command lives in its own module under ``commands/``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pp_core import __version__
from pp_core.app.interrupts import Interrupted, exit_code, signals_raise
from pp_core.app.logs import configure_logging
from pp_core.errors import PPCoreError

__all__ = ["main", "build_parser"]

DESCRIPTION = """\
pp-core trains PyTorch models with pipeline parallelism.

Describe a pipeline in YAML (model, data, schedule, microbatches, pp x dp sizes)
and run it with one command; inspect any schedule before you spend a GPU on it.
"""

EPILOG = """\
examples:
  pp-core run examples/demo.yaml                  train the demo GPT on 2 ranks
  pp-core run pipe.yaml --set train.steps=10      override any YAML key
  pp-core validate pipe.yaml                      check a pipeline without running it
  pp-core plan pipe.yaml --memory-cap 8GiB        rank schedules and splits by measured cost
  pp-core plan pipe.yaml --world 8                choose the whole layout for 8 ranks
  pp-core export ckpt --format hf -o hf_model     a checkpoint as a save_pretrained directory
  pp-core schedule show zero_bubble --pp 4 --microbatches 8
                                                  draw a schedule's timeline
  pp-core schedule simulate 1f1b --pp 4 --microbatches 8 --json
                                                  bubble, makespan, peak activations
  pp-core schedule export interleaved_1f1b --pp 4 --microbatches 8 -o order.csv
                                                  write a torch-compatible CSV
  pp-core plugins                                 every installed plugin and what it provides

Plugins are pip packages that register in the entry-point group 'pp_core';
set PP_CORE_DISABLE_PLUGINS=name,... to skip some.
"""

COMMAND_MODULES = ("run", "validate", "export", "plan", "schedule", "plugins")
"""One module per command under ``commands/``, each with ``register(subparsers)``; the parser's
commands are these names (``tests/structure/test_commands.py``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pp-core",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    parser.add_argument("--version", action="version", version=f"pp-core {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"pp_core.app.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        configure_logging()
        with signals_raise():  # SIGTERM ends a command as Ctrl-C does, its cleanup run
            return int(args.func(args) or 0)
    except (KeyboardInterrupt, Interrupted) as exc:  # not one line of traceback for a Ctrl-C
        sigval, code = exit_code(exc)
        print(f"\npp-core: interrupted by {sigval.name}", file=sys.stderr)
        return code  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    except PPCoreError as exc:
        print(f"pp-core: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `pp-core ... | head`: the reader left, which is not an error

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
