"""A registry of named things plugins register (schedules, splitters, models, datasets): a
duplicate is refused at the moment it is registered, naming both plugins; an unknown name is
refused with the closest ones and every installed one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from pp_core.callables import LazyCallable
from pp_core.errors import PluginError, did_you_mean
from pp_core.plugin_faults import DISABLE_ENV

__all__ = ["Registry", "RegistryEntry"]


@dataclass
class RegistryEntry:
    name: str
    value: Any
    plugin: str
    aliases: tuple[str, ...] = ()


@dataclass
class Registry:
    """Named things registered by plugins (schedules, splitters, models, datasets)."""

    kind: str
    entries: dict[str, RegistryEntry] = field(default_factory=dict)
    _lookup: dict[str, RegistryEntry] = field(default_factory=dict)

    def add(self, name: str, value: Any, plugin: str, aliases: Iterable[str] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with name {name!r}; "
                              f"names must be non-empty strings")
        entry = RegistryEntry(name, value, plugin, tuple(aliases))
        for key in (name, *entry.aliases):
            other = self._lookup.get(key.lower())
            if other is not None:
                raise PluginError(
                    f"{self.kind} {key!r} is registered twice: by plugin {other.plugin!r} "
                    f"(as {other.name!r}) and by plugin {plugin!r} (as {name!r}); uninstall one, "
                    f"or skip one with {DISABLE_ENV}=<plugin name>"
                )
        for key in (name, *entry.aliases):
            self._lookup[key.lower()] = entry
        self.entries[name] = entry

    def __contains__(self, name: str) -> bool:
        return isinstance(name, str) and name.lower() in self._lookup

    def __iter__(self):
        return iter(self.entries.values())

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> RegistryEntry:
        found = self._lookup.get(str(name).lower())
        if found is not None:
            return found
        installed = ", ".join(f"{e.name} (from {e.plugin})" for e in self.entries.values())
        hint = did_you_mean(str(name).lower(), self._lookup,
                            show=lambda key: repr(self._lookup[key].name), after=" ")
        raise PluginError(
            f"unknown {self.kind} {name!r}; {hint}installed {self.kind}s: {installed or 'none'}; "
            f"run 'pp-core plugins' to see every plugin"
        )

    def get(self, name: str) -> Any:
        """What ``name`` was registered as; a factory registered by name
        (:class:`~pp_core.callables.LazyCallable`) is imported now and given as itself."""
        value = self.entry(name).value
        return value.__wrapped__ if isinstance(value, LazyCallable) else value
