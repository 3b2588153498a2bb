"""The runtime-initializer protocol: what a model-owned, process-local resource must offer.

A core type (the hook spec ``pp_runtime_initializers`` returns it), so it lives here, beside the
hook specs, and not with its collector in :mod:`pp_core.runtime.initializers` (which re-exports it,
as DESIGN.md's ``pp_core.runtime`` contract promises). Pure typing: no torch at run time.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

from pp_core.errors import PluginError

__all__ = ["PipelineRuntimeInitializer", "checked_initializers"]


@runtime_checkable
class PipelineRuntimeInitializer(Protocol):
    """Makes one process-local resource ready for the next microbatch.

    ``resource_key`` identifies the resource (two initializers with the same key own the same
    thing); ``signature`` is the immutable configuration expected for that key (two initializers
    with the same key must agree on it). Both must be hashable.
    """

    resource_key: Hashable
    signature: Hashable

    def prepare(self, num_tokens: int, device: "torch.device") -> None:
        """Make the resource ready for a microbatch of at most ``num_tokens`` tokens.

        pp-core always calls ``prepare(num_tokens=..., device=...)`` by keyword, so an
        initializer written to NeMo AutoModel's keyword-only ``prepare(self, *, num_tokens,
        device)`` works unchanged.
        """
        ...


def checked_initializers(result, origin, what: str) -> list:
    """``result`` of a ``pp_runtime_initializers`` hook or a model's own method as a list of
    initializers, or a :class:`~pp_core.errors.PluginError` naming ``origin`` (a string, or a
    function that says it) and ``what`` was called: a list or tuple (or another iterable, read
    here) of objects with ``resource_key``, ``signature`` and a callable ``prepare``."""
    def fault(found: str) -> PluginError:
        who = origin() if callable(origin) else origin
        return PluginError(f"{who}: {what} returned {found}; return a list of runtime "
                           f"initializers (objects with resource_key, signature and "
                           f"prepare(num_tokens, device)), or None for none")

    if isinstance(result, dict):
        raise fault(f"a dict (keys {list(result)[:4]!r}), not a list of its values")
    if isinstance(result, (str, bytes)) or not hasattr(result, "__iter__"):
        raise fault(f"{type(result).__name__} {repr(result)[:60]}")
    try:
        items = list(result)
    except Exception as exc:  # noqa: BLE001 - a generator of the provider's that raised
        who = origin() if callable(origin) else origin
        raise PluginError(f"{who}: {what} raised {type(exc).__name__}: {str(exc)[:200]} while "
                          f"its result was read; this is a defect of that code: fix it") from exc
    for item in items:
        missing = [name for name in ("resource_key", "signature") if not hasattr(item, name)]
        if not callable(getattr(item, "prepare", None)):
            missing.append("prepare()")
        if missing:
            raise fault(f"a {type(item).__name__} without {', '.join(missing)} in its list")
    return items
