"""A plugin that is wrong in any way is reported, and the other plugins keep working.

A plugin can be wrong when it is imported (an exception), when pluggy validates it (a hook
implementation whose arguments are not the spec's, an unknown ``pp_*`` hook), when its
registration hook runs (it raises, or registers a bad name), and at every later call into what it
registered (a splitter's ``accepts()`` or ``split()``, a model or dataset factory, a
``pp_runtime_initializers`` hook). The first three are caught by
:func:`~pp_core.plugin_manager.make_plugin_manager` and ``Plugins``' registries, which record a
:class:`BrokenPlugin` (``pp-core plugins`` lists it as broken) and leave it out; the last by
:func:`plugin_call` (and :func:`factory_call`, for a factory called with the YAML's arguments),
which turns the raw exception into a :class:`~pp_core.errors.PluginError` naming the plugin, its
distribution and the call. One place for every way, so a new hook or call site inherits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pp_core.errors import PluginError, PPCoreError, shorten

__all__ = ["BrokenPlugin", "plugin_call", "factory_call", "code_origin", "DISABLE_ENV"]

DISABLE_ENV = "PP_CORE_DISABLE_PLUGINS"


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin left out; listed by ``pp-core plugins`` instead of crashing.

    ``stage``: ``import`` (its module raised), ``validation`` (pluggy refused its hooks) or the
    hook it raised in (``pp_register_splitters``, ...).
    """

    name: str
    distribution: str
    version: str
    error: str
    stage: str = "import"

    def message(self) -> str:
        what = {"import": "failed to import", "validation": "failed validation"}.get(
            self.stage, f"raised in {self.stage}")
        return (
            f"plugin {self.name!r} ({self.distribution} {self.version}) {what}: "
            f"{self.error}; fix or reinstall {self.distribution}, or skip it with "
            f"{DISABLE_ENV}={self.name}"
        )


def code_origin(obj: Any) -> str:
    """``class 'Block' of module 'pkg.blocks' (pkg-dist 1.0)``: where the code of ``obj``'s
    class comes from, with the distribution that installed it when one did."""
    from importlib import metadata  # lazy: read only when a call into that code failed

    cls = obj if isinstance(obj, type) else type(obj)
    module = getattr(cls, "__module__", "?") or "?"
    dists = metadata.packages_distributions().get(module.split(".")[0], [])
    found = ""
    if dists:
        try:
            found = f" ({dists[0]} {metadata.version(dists[0])})"
        except metadata.PackageNotFoundError:
            found = f" ({dists[0]})"
    return f"class {cls.__qualname__!r} of module {module!r}{found}"


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shorten(str(exc), 400)}"


def plugin_call(origin: str, what: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, a call into plugin code; an exception other than pp-core's
    own errors (a plugin may refuse with a :class:`~pp_core.errors.ConfigError`) becomes a
    :class:`PluginError` saying which plugin's which call failed.

    :param origin: who provides it, e.g. ``"splitter 'mine' from plugin 'x' (pp-x 1.0)"``, or a
        function that says it (asked only when the call raised).
    :param what: the call, e.g. ``"split(model, num_stages, config)"``.
    """
    try:
        return function(*args, **kwargs)
    except PPCoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - any defect of the plugin's code
        origin = origin() if callable(origin) else origin
        raise PluginError(f"{origin}: {what} raised {describe_error(exc)}; this is a defect of "
                          f"the plugin: fix it, name another, or skip the plugin with "
                          f"{DISABLE_ENV}=<plugin name>") from exc


def factory_call(origin: str, what: str, key: str, function: Callable, arguments: dict,
                 note: str = "") -> Any:
    """``function(**arguments)``, a factory a plugin registered (a model, a dataset) called with
    the YAML's ``key`` (``model.args``): an exception other than pp-core's own becomes a
    :class:`PluginError` that blames the arguments or, when they are right, the plugin.

    :param origin: e.g. ``"model 'gpt' from plugin 'x' (pp-x 1.0)"``.
    :param what: the subject of the message, e.g. ``"the model factory"``.
    :param note: said after "refused these arguments", e.g. why evaluation builds it.
    """
    try:
        return function(**arguments)
    except PPCoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - the arguments, or a defect of the plugin's code
        raise PluginError(f"{what} refused these arguments{note} ({describe_error(exc)}); fix "
                          f"{key}, or {origin} if the arguments are right (skip a broken "
                          f"plugin with {DISABLE_ENV}=<plugin name>)") from exc
