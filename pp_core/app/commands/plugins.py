"""``pp-core plugins``: every installed plugin, its distribution, and what it provides."""

from __future__ import annotations

import argparse
import json

from pp_core import __version__
from pp_core.errors import DISTRIBUTION
from pp_core.plugin_manager import CORE_PLUGIN_NAME, load_plugins

HELP = """\
List every pp-core plugin: its entry-point name, the distribution and version
that installed it, and what it provides (schedules with their aliases,
splitters, models, datasets, initializer and runtime hooks). A plugin that fails
to import is listed with its error instead of breaking the listing.

Plugins are found through the entry-point group 'pp_core'; install one with pip
and it appears here. Skip some with PP_CORE_DISABLE_PLUGINS=name,... .
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plugins",
        help="list installed plugins and what they provide",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")
    parser.set_defaults(func=run)


def describe(plugins) -> list[dict]:
    """One record per plugin: name, distribution, version, what it provides, or its error."""
    rows: dict[str, dict] = {}
    for name, _plugin in plugins.pm.list_name_plugin():
        dist, version = plugins.distribution(name)
        if name == CORE_PLUGIN_NAME:
            dist, version = DISTRIBUTION, _core_version()
        hooks = sorted(h.name for h in plugins.pm.get_hookcallers(_plugin) or [])
        rows[name] = {"name": name, "distribution": dist, "version": version, "hooks": hooks,
                      "provides": {}, "error": None,
                      # a plugin whose optional dependency is missing says so, with the fix
                      "unavailable": getattr(_plugin, "PP_CORE_UNAVAILABLE", None)}
    registries = []
    for kind in ("schedules", "splitters", "models", "datasets"):
        try:
            registries.append((kind, getattr(plugins, kind)))
        except Exception as exc:  # a clash or a raising plugin: show it, keep listing
            rows.setdefault("<registry>", {"name": f"<{kind}>", "distribution": "", "version": "",
                                           "hooks": [], "provides": {}, "error": str(exc),
                                           "unavailable": None})
    for kind, registry in registries:
        for entry in registry:
            label = entry.name + (f" (aliases: {', '.join(entry.aliases)})" if entry.aliases else "")
            rows[entry.plugin]["provides"].setdefault(kind, []).append(label)
    for broken in plugins.broken:
        rows[broken.name] = {"name": broken.name, "distribution": broken.distribution,
                             "version": broken.version, "hooks": [], "provides": {},
                             "error": broken.message(), "unavailable": None}
    return list(rows.values())


def _core_version() -> str:
    return __version__


def run(args) -> int:
    rows = describe(load_plugins())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        origin = f"{row['distribution']} {row['version']}".strip()
        print(f"{row['name']}  [{origin}]")
        if row["error"]:
            print(f"    BROKEN: {row['error']}")
            continue
        if row["unavailable"]:
            print(f"    unavailable: {row['unavailable']}")
        for kind, items in row["provides"].items():
            print(f"    {kind}: {', '.join(items)}")
        other = [h for h in row["hooks"] if not h.startswith("pp_register_")]
        if other:
            print(f"    hooks: {', '.join(other)}")
    return 0
