"""Error types: every user-facing failure in pp-core is one of these, never an ``AssertionError``.

Each message names the thing that is wrong (YAML key, plugin, schedule action, stage) and the fix.
"""

from __future__ import annotations

import contextlib
import difflib
import reprlib

__all__ = ["PPCoreError", "PluginError", "ScheduleError", "ScheduleFileNotFoundError",
           "ConfigError", "PipelineError", "quoted",
           "shorten", "closest", "did_you_mean", "about", "DISTRIBUTION", "install_extra"]

DISTRIBUTION = "pp-core-torch"
"""pp-core's name on the package index (``pp-core`` there is another project, a Zope package:
``-``, ``_`` and ``.`` make one name). The import name ``pp_core``, the command ``pp-core`` and
the entry-point group ``pp_core`` keep theirs."""


def install_extra(extra: str) -> str:
    """``pip install 'pp-core-torch[lora]'``: what a message about a missing extra tells."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


class PPCoreError(Exception):
    """Base class of every error pp-core raises on purpose.

    ``field`` names the setting the error is about - a :class:`~pp_core.PipelineConfig` field
    such as ``"pp_batch_size"`` - when one is known, so that the YAML application can report it
    as ``pipeline.<field>`` without reading the message.
    """

    field: str | None = None

    def __init__(self, *args, field: str | None = None):
        super().__init__(*args)
        if field is not None:
            self.field = field


class PluginError(PPCoreError):
    """A plugin could not be loaded, or registered something that clashes with another plugin."""


class ScheduleError(PPCoreError, ValueError):
    """A schedule is malformed, incomplete, would deadlock, or cannot be built for these sizes."""


class ScheduleFileNotFoundError(ScheduleError, FileNotFoundError):
    """A schedule CSV that does not exist: a :class:`ScheduleError`, and a ``FileNotFoundError``
    for code written against NeMo AutoModel (or plain Python) that catches that."""


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

    bounded = reprlib.Repr()  # cost bounded too: a shared alias list may hold 10**9 items
    bounded.maxstring = bounded.maxother = bounded.maxlong = limit
    return shorten(bounded.repr(value), limit)


def shorten(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text):,} chars)"


def closest(word, options, cutoff: float = 0.6) -> str | None:
    """The option most like ``word`` (``difflib``), or ``None`` when none is close enough."""
    found = difflib.get_close_matches(str(word), list(options), n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(word, options, *, n: int = 1, cutoff: float = 0.6, show=repr,
                 before: str = "", after: str = "") -> str:
    """``before + "did you mean 'x'?" + after`` naming up to ``n`` options like ``word``, or ``""``
    when none is close: the one "did you mean" hint of every message. ``show`` writes an option
    as the user would type it (e.g. ``'pipeline.pp_schedule'``)."""
    found = difflib.get_close_matches(str(word), list(options), n=n, cutoff=cutoff)
    if not found:
        return ""
    return f"{before}did you mean {', '.join(show(option) for option in found)}?{after}"


@contextlib.contextmanager
def about(field: str):
    """Tag the pp-core errors raised inside with ``field`` (see :class:`PPCoreError`) unless
    they already name one: for checks that call code which does not know the setting."""
    try:
        yield
    except PPCoreError as exc:
        if exc.field is None:
            exc.field = field
        raise
