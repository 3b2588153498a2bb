"""Loading plugins: the ``pp_core`` entry points into a fresh pluggy manager, one by one.

:func:`make_plugin_manager` adds pp-core's hook specs and the core's own plugin, loads each entry
point apart (so an import failure names the entry point and its distribution, and the plugin is
left out and listed rather than ending the run), honours ``PP_CORE_DISABLE_PLUGINS``, then checks
every hook name (pluggy names only the object's repr; the message here names the plugin).
Public through :mod:`pp_core.plugin_manager`, where the facade over the result lives.
"""

from __future__ import annotations

import logging
import os
import warnings
from importlib import metadata
from typing import Any, Iterable

import pluggy

from pp_core import hookspecs
from pp_core.errors import PluginError, did_you_mean
from pp_core.model_initializers import ModelInitializers
from pp_core.plugin_faults import DISABLE_ENV, BrokenPlugin, describe_error

__all__ = ["ENTRY_POINT_GROUP", "CORE_PLUGIN_NAME", "PPCorePluginManager", "make_plugin_manager",
           "disabled_plugin_names", "check_pending", "leave_out"]

ENTRY_POINT_GROUP = "pp_core"
CORE_PLUGIN_NAME = "pp_core.model_initializers"

logger = logging.getLogger("pp_core.plugin_manager")  # the name users filter records by


def disabled_plugin_names(environ: dict | None = None) -> set[str]:
    value = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return {name.strip() for name in value.split(",") if name.strip()}


def _warn_unknown_disabled(blocked: set[str]) -> None:
    """A name in $PP_CORE_DISABLE_PLUGINS that no plugin has disables nothing: say so, with the
    closest name and the known ones, rather than leave the user believing it worked."""
    known = [ep.name for ep in _entry_points()]
    for name in sorted(blocked - set(known)):
        hint = did_you_mean(name, known, after=" ")
        warnings.warn(f"{DISABLE_ENV}: no installed plugin is named {name!r}, so it disables "
                      f"nothing; {hint}installed plugins: {', '.join(known) or 'none'}",
                      UserWarning, stacklevel=3)


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _distribution_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown distribution", "?"
    return dist.metadata["Name"], dist.version


class PPCorePluginManager(pluggy.PluginManager):
    """pluggy's manager with what pp-core learns while loading: the plugins left out
    (:attr:`broken`) and the distribution of each installed one (:attr:`distributions`)."""

    def __init__(self, project_name: str = hookspecs.PROJECT_NAME):
        super().__init__(project_name)
        self.broken: list[BrokenPlugin] = []  # failed to load, validate or register: left out
        self.distributions: dict[str, tuple[str, str]] = {}  # entry-point name: (dist, version)


def make_plugin_manager(
    entry_points: bool = True,
    plugins: Iterable[Any] = (),
    disabled: Iterable[str] | None = None,
) -> PPCorePluginManager:
    """A fresh plugin manager with pp-core's hook specs and built-in model-initializer hook.

    :param entry_points: load the ``pp_core`` entry-point group, one entry at a time; a plugin
        that fails to import is recorded in ``pm.broken`` (a list of :class:`BrokenPlugin`)
        and the others still load.
    :param plugins: extra plugin objects (or ``(name, object)`` pairs) to register in-process.
    :param disabled: entry-point names to skip; defaults to ``$PP_CORE_DISABLE_PLUGINS``.
    """
    pm = PPCorePluginManager()
    pm.add_hookspecs(hookspecs)

    pm.register(ModelInitializers(), name=CORE_PLUGIN_NAME)
    blocked = disabled_plugin_names() if disabled is None else set(disabled)
    for name in blocked:
        pm.set_blocked(name)
    if entry_points:
        _warn_unknown_disabled(blocked)
        for ep in _entry_points():
            if ep.name in blocked or pm.get_plugin(ep.name) is not None:
                continue
            dist, version = _distribution_of(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # a plugin defect: report it, keep the others
                leave_out(pm, BrokenPlugin(ep.name, dist, version, describe_error(exc)))
                continue
            try:  # pluggy checks each hook's arguments against its spec here
                pm.register(plugin, name=ep.name)
                _check_hook_names(pm, ep.name, plugin)
            except Exception as exc:  # noqa: BLE001 - PluginValidationError and the like
                if pm.get_plugin(ep.name) is not None:
                    pm.unregister(name=ep.name)
                leave_out(pm, BrokenPlugin(ep.name, dist, version, describe_error(exc),
                                           "validation"))
                continue
            pm.distributions[ep.name] = (dist, version)
    for item in plugins:
        name, plugin = item if isinstance(item, tuple) else (_plugin_name(pm, item), item)
        pm.register(plugin, name=name)
    check_pending(pm)
    return pm


def _plugin_name(pm: pluggy.PluginManager, plugin: Any) -> str:
    """A readable name for an in-process plugin: its module name or class name, made unique."""
    base = getattr(plugin, "__name__", None) or type(plugin).__name__
    name, suffix = base, 1
    while pm.get_plugin(name) is not None or pm.is_blocked(name):
        suffix += 1
        name = f"{base}#{suffix}"
    return name


def leave_out(pm: PPCorePluginManager, broken: BrokenPlugin) -> None:
    pm.broken.append(broken)
    logger.warning(broken.message())


def _check_hook_names(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    """Raise a PluginError naming the plugin when it implements a hook pp-core does not know."""
    known = sorted(n for n in dir(hookspecs) if n.startswith("pp_"))
    for attr in dir(plugin):
        if not attr.startswith("pp_"):
            continue
        caller = getattr(pm.hook, attr, None)
        if caller is None or not caller.has_spec():
            if pm.parse_hookimpl_opts(plugin, attr) is None:
                continue
            hint = did_you_mean(attr, known, after=" ")
            raise PluginError(
                f"plugin {name!r} implements unknown hook {attr!r}; {hint}"
                f"known hooks: {', '.join(known)}"
            )


def check_pending(pm: pluggy.PluginManager) -> None:
    """pluggy's ``check_pending`` with a message that names the plugin and lists the known hooks."""
    for name, plugin in pm.list_name_plugin():
        _check_hook_names(pm, name, plugin)
    pm.check_pending()
