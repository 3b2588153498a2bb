"""Where this run's ranks live, decided once from the spec: :class:`MachineShare`.

The device and backend (:func:`pp_core.devices.choose_device` fed this machine's facts), how
many ranks run on this machine, the CPU threads each gets and the processors one pipeline's
ranks share. The launcher, ``validate``, the measuring code and every rank read these figures
from one value, so they cannot disagree; the core helpers in :mod:`pp_core.devices` take plain
numbers and never read the YAML spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pp_core.devices import (
    choose_device,
    cpu_cores,
    cpu_threads_per_rank,
    cuda_device_count,
    shared_processors,
)

if TYPE_CHECKING:
    from pp_core.app.spec import Spec
    from pp_core.app.spec.sections import DistributedSpec

__all__ = ["MachineShare", "local_ranks"]


def local_ranks(distributed: "DistributedSpec", environ=None) -> int:
    """How many ranks run on this machine (:meth:`ParallelDims.local_ranks
    <pp_core.parallel.dims.ParallelDims.local_ranks>` of the section's degrees)."""
    return distributed.dims.local_ranks(distributed.max_nodes, distributed.nproc_per_node, environ)


@dataclass(frozen=True)
class MachineShare:
    """This machine's share of the run: device type (``"cpu"``/``"cuda"``), backend, why that
    device, local ranks, intra-op threads per CPU rank, and the processors one pipeline's CPU
    ranks share (``None``: a processor each, or GPUs)."""

    device: str
    backend: str
    reason: str
    local_ranks: int
    threads_per_rank: int
    processors: float | None

    @classmethod
    def of(cls, spec: "Spec", environ=None) -> "MachineShare":
        """The layout for ``spec`` on this machine. Raises :class:`~pp_core.errors.ConfigError`
        (naming ``distributed.device`` / ``backend``) for a device the machine cannot give."""
        dist = spec.distributed
        ranks = local_ranks(dist, environ)
        choice = choose_device(dist.device, ranks, cuda_device_count(), dist.backend)
        threads = cpu_threads_per_rank(ranks, environ)
        processors = None if choice.device != "cpu" else \
            shared_processors(cpu_cores(), threads, ranks, dist.pp_size)
        return cls(choice.device, choice.backend, choice.reason, ranks, threads, processors)
