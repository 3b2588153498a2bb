"""One module per command: ``COMMAND_MODULES`` (``app/cli.py``) names every module under
``app/commands/`` that registers a command, each registers exactly the command it is named for,
and the parser's commands are those names, in that order."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from pp_core.app.cli import COMMAND_MODULES, build_parser

COMMANDS = Path(__file__).resolve().parents[2] / "pp_core" / "app" / "commands"


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [name for action in found for name in action.choices]


def test_the_parsers_commands_are_the_command_modules():
    assert _commands(build_parser()) == list(COMMAND_MODULES)
    registering = sorted(path.stem for path in COMMANDS.glob("*.py")
                         if "\ndef register(" in path.read_text())
    assert registering == sorted(COMMAND_MODULES), \
        "a module under app/commands/ registers a command COMMAND_MODULES does not list"


def test_each_command_module_registers_the_one_command_it_is_named_for():
    for name in COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        importlib.import_module(f"pp_core.app.commands.{name}").register(
            parser.add_subparsers())
        assert _commands(parser) == [name], name
