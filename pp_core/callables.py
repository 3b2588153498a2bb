"""Code named in configuration: a callable, or an importable ``"module:attr"`` string.

YAML cannot hold a function, so a loss, a model factory or a dataset names one as
``"package.module:attr"``. Resolving it imports that module; every field that accepts such a
reference resolves it here, so each gives the same message for a typo.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from pp_core.errors import ConfigError, did_you_mean

__all__ = ["resolve_callable"]


def resolve_callable(value: Any, field_name: str = "loss_fn") -> Callable:
    """A callable from a callable or an importable ``"module:attr"`` string (imports code!)."""
    if callable(value):
        return value
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(
            f"{field_name}={value!r} is neither a callable nor a 'module:attr' string; pass a "
            f"function, or a string such as 'torch.nn.functional:cross_entropy'"
        )
    module_name, _, attr = value.partition(":")
    if not module_name.strip() or not all(attr.split(".")):  # ":" or "mod:" or "mod:a..b"
        raise ConfigError(
            f"{field_name}={value!r}: expected 'module:attr' with both parts named, e.g. "
            f"'torch.nn.functional:cross_entropy'")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as exc:  # ValueError: e.g. a relative name
        raise ConfigError(
            f"{field_name}={value!r}: cannot import module {module_name!r} ({exc}); check the "
            f"spelling or install the package that provides it"
        ) from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            hint = did_you_mean(part, names, show=lambda name: f"'{module_name}:{name}'",
                                before="; ")
            raise ConfigError(f"{field_name}={value!r}: {module_name!r} has no attribute "
                              f"{attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field_name}={value!r} names {type(target).__name__}, not a callable")
    return target
