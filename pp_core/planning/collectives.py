"""What a collective costs at a group size, fitted from measurements: :class:`Collectives`.

The layout search (``pp-core plan --world N``) charges each layout the collectives its degrees
add: the dp all-reduce of gradients (``dp_replicate``), FSDP2's all-gather of a stage's
parameters and reduce-scatter of its gradients once per stage and step (``dp_shard``), and the
MoE all-to-all of tokens at the ep degree (dispatch and combine, in the forward and again in
the backward). Tensor parallelism's collectives are not here: a tp stage is profiled by its tp
processes, collectives included.

Each kind is the ring model ``t = steps(g) * latency + volume(g) * bytes / bandwidth`` with
``latency`` and ``bandwidth`` fitted from two message sizes measured on this machine at a group
size ``g`` (:mod:`pp_core.measure.collectives`); at a group size not measured the fit of the
largest measured one below it serves (the ring factors carry the size). Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping

__all__ = ["Collectives", "EngineCosts", "KINDS", "ring_factors", "fit"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def ring_factors(kind: str, group: int) -> tuple[float, float]:
    """``(steps, volume)`` of ``kind`` on a ring of ``group``: the latencies paid in a row and
    the share of the (whole, unsharded) tensor's bytes each rank moves."""
    if group <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":  # reduce-scatter then all-gather
        return 2.0 * (group - 1), 2.0 * (group - 1) / group
    if kind in KINDS:
        return float(group - 1), (group - 1) / group
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


def fit(kind: str, group: int, small: tuple[int, float],
        large: tuple[int, float]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of the ring model through two measured
    ``(bytes, seconds)`` points (bandwidth infinite when the large one was not slower)."""
    steps, volume = ring_factors(kind, group)
    extra_s = large[1] - small[1]
    rate = (large[0] - small[0]) * volume / extra_s if extra_s > 0 else math.inf
    latency = max(0.0, small[1] - small[0] * volume / rate) / steps if steps else 0.0
    return latency, rate


@dataclass(frozen=True)
class EngineCosts:
    """What torch's data-parallel engine (FSDP2) costs a rank besides its collectives
    (:mod:`pp_core.measure.engine`): its hooks per wrapped module and forward / backward call,
    and DTensor's dispatch per parameter tensor in a step's gradient norm and optimizer step.
    Zero: not measured."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s_per_tensor: float = 0.0


@dataclass(frozen=True)
class Collectives:
    """``fits[(kind, group)] = (latency_s, bytes_per_s)``; empty: every collective is free
    (nothing measured, e.g. ``--no-link``). ``engine``: what the data-parallel engine costs
    besides (measured with the collectives, in the same helper processes)."""

    fits: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    engine: EngineCosts = EngineCosts()

    def seconds(self, kind: str, group: int, num_bytes: float) -> float:
        """Predicted time of one ``kind`` over ``group`` ranks of a ``num_bytes`` tensor."""
        if group <= 1 or num_bytes <= 0:
            return 0.0
        measured = sorted(g for k, g in self.fits if k == kind)
        if not measured:
            return 0.0
        below = [g for g in measured if g <= group]
        latency, rate = self.fits[(kind, below[-1] if below else measured[0])]
        steps, volume = ring_factors(kind, group)
        return steps * latency + volume * num_bytes / rate

    def gradient_sync_s(self, trained_bytes: int, param_bytes: int, dp_replicate: int,
                        dp_shard: int, pieces: int = 1) -> float:
        """A rank's data-parallel collectives per step, its bytes in ``pieces`` equal FSDP
        units (one collective each: pp-core drives FSDP2 and ``replicate`` once per unit and
        step): the all-gather of the parameters and reduce-scatter of the gradients over
        ``dp_shard``, then the all-reduce of the (shard of the) gradients over
        ``dp_replicate`` (HSDP when both)."""
        pieces = max(1, pieces)
        trained, params = trained_bytes / pieces, param_bytes / pieces
        one = self.seconds("all_gather", dp_shard, params) + \
            self.seconds("reduce_scatter", dp_shard, trained) + \
            self.seconds("all_reduce", dp_replicate, trained / dp_shard)
        return pieces * one

    def to_dict(self) -> dict:
        found = {f"{kind}@{group}": {"latency_s": latency, "bytes_per_s": rate}
                 for (kind, group), (latency, rate) in sorted(self.fits.items())}
        return {**found, "engine": asdict(self.engine)}
