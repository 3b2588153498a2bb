"""The built-in models' and datasets' arguments checked against their own annotations.

YAML hands a factory whatever the file says: ``pack: "false"`` is a non-empty string, so a plain
``bool(pack)`` packs; ``aux_loss_coef: "0.01"`` fails (or not) deep in the first step;
``seq_len: true`` is the int 1. Each built-in constructor calls :func:`check_arg_types` first, so
validate (which calls the factory on the meta device) and every rank refuse the same values, with
one message naming the argument, the value and the type the annotation asks for.
"""

from __future__ import annotations

import collections.abc
import os
import types
import typing

__all__ = ["check_arg_types"]

_NAMES = {bool: "true or false", int: "an int", float: "a number", str: "a string",
          type(None): "null"}


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:  # (a path from Python may be a pathlib.Path)
        return isinstance(value, (str, os.PathLike))
    if hint is type(None):
        return value is None
    if origin in (collections.abc.Sequence, list, tuple):
        args = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and \
            (not args or all(_matches(item, args[0]) for item in value))
    return True  # Any, or a type this check does not read


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin in (collections.abc.Sequence, list, tuple):
        args = typing.get_args(hint)
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s" \
            if args else "a list"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def check_arg_types(owner: str, function, values: dict) -> None:
    """Raise ``TypeError`` naming ``owner``'s argument whose value is not of its annotated type
    (``values``: the call's arguments, e.g. ``locals()`` at the top of ``__init__``)."""
    hints = typing.get_type_hints(function)
    for name, hint in hints.items():
        if name == "return" or name not in values:
            continue
        value = values[name]
        if not _matches(value, hint):
            quoted = f" (a string: write {value} without quotes?)" if isinstance(value, str) \
                and value.strip().lower() in ("true", "false", "yes", "no", "on", "off") or \
                isinstance(value, str) and _is_number(value) else ""
            raise TypeError(f"{owner}: {name}={value!r} must be {_describe(hint)}{quoted}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
