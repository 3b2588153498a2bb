"""Helpers for testing pp-core plugins, for plugin authors and for pp-core's own tests.

A plugin test wants a plugin manager holding exactly the plugins it names — its own plugin object,
perhaps a few built-ins — and no global state to reset afterwards::

    from pp_core.testing import plugins_with

    def test_my_schedule_is_registered():
        plugins = plugins_with("pp_core_builtins.schedules.gpipe", my_plugin_module)
        assert "my_schedule" in plugins.schedules
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pp_core.errors import PluginError
from pp_core.plugin_manager import (ENTRY_POINT_GROUP, Plugins, PPCorePluginManager,
                                    make_plugin_manager)

__all__ = ["plugin_manager", "plugins_with", "installed_entry_point"]


def installed_entry_point(name: str) -> metadata.EntryPoint:
    """The installed ``pp_core`` entry point called ``name``
    (e.g. ``"pp_core_builtins.schedules.gpipe"``)."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    known = sorted(ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    raise PluginError(f"no installed pp_core entry point {name!r}; installed: {', '.join(known)}")


def plugin_manager(*plugins: Any) -> PPCorePluginManager:
    """A fresh plugin manager with only ``plugins`` (plus the core's model-initializer hook).

    Each item is an installed entry-point name (a string, loaded and registered under that
    name), a ``(name, object)`` pair, or a plugin object (module, class instance) registered in
    process under its ``__name__`` or a generated name.
    """
    resolved = []
    for item in plugins:
        if isinstance(item, str):
            resolved.append((item, installed_entry_point(item).load()))
        else:
            resolved.append(item)
    return make_plugin_manager(entry_points=False, plugins=resolved, disabled=())


def plugins_with(*plugins: Any) -> Plugins:
    """Like :func:`plugin_manager`, wrapped in the :class:`~pp_core.plugin_manager.Plugins` facade."""
    return Plugins(plugin_manager(*plugins))
