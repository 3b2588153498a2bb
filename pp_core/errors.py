"""Error types: every user-facing failure in pp-core is one of these, never an ``AssertionError``.

Each message names the thing that is wrong (YAML key, plugin, schedule action, stage) and the fix.
"""

__all__ = ["PPCoreError", "PluginError", "ScheduleError", "ConfigError", "PipelineError", "quoted",
           "shorten"]


class PPCoreError(Exception):
    """Base class of every error pp-core raises on purpose."""


class PluginError(PPCoreError):
    """A plugin could not be loaded, or registered something that clashes with another plugin."""


class ScheduleError(PPCoreError, ValueError):
    """A schedule is malformed, incomplete, would deadlock, or cannot be built for these sizes."""


class ConfigError(PPCoreError, ValueError):
    """A ``PipelineConfig`` field or a YAML key has a value that cannot work."""


class PipelineError(PPCoreError, RuntimeError):
    """The runtime failed: a rank raised, a peer died, or the model cannot be split as asked."""


def quoted(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: every message that quotes user input uses it,
    so a 20-byte file cannot produce a 90 MB message."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else \
            f"{value[:limit - 20]!r}... ({len(value):,} chars)"
    import reprlib

    bounded = reprlib.Repr()  # cost bounded too: a shared alias list may hold 10**9 items
    bounded.maxstring = bounded.maxother = bounded.maxlong = limit
    return shorten(bounded.repr(value), limit)


def shorten(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text):,} chars)"
