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

__all__ = ["PipelineRuntimeInitializer"]


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
