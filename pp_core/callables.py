"""Code named in configuration: a callable, or an importable ``"module:attr"`` string.

YAML cannot hold a function, so a loss, a model factory or a dataset names one as
``"package.module:attr"``. Resolving it imports that module; every field that accepts such a
reference resolves it here, so each gives the same message for a typo. A plugin registers a
factory whose module needs torch as a :class:`LazyCallable`, imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from pp_core.errors import ConfigError, did_you_mean

__all__ = ["resolve_callable", "LazyCallable"]


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


class LazyCallable:
    """The callable ``"module:attr"``, imported on first use.

    A plugin registers a model or dataset factory whose module imports torch as
    ``register("gpt", LazyCallable("my_plugin.gpt:GPT"))``: registering it imports nothing, and
    ``pp-core plugins`` and the schedule commands, which register every plugin's, stay free of
    torch. Calling it calls the target; ``inspect.signature`` sees the target's (through
    ``__wrapped__``), and its other public attributes, ``__name__`` and ``__qualname__`` are the
    target's.
    """

    def __init__(self, ref: str):
        self.ref = ref
        self._target = None

    @property
    def __wrapped__(self) -> Callable:
        if self._target is None:
            self._target = resolve_callable(self.ref, "a factory registered by name")
        return self._target

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") and name not in ("__name__", "__qualname__"):
            raise AttributeError(name)  # copy and pickle probe for dunders: none here
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<{self.ref}, imported on first use>" if self._target is None else \
            repr(self._target)
