"""The parallel layouts a world of N processes admits: :func:`enumerate_layouts`.

``pp-core plan FILE --world N`` ranks every factorisation ``pp * dp_replicate * dp_shard * tp``
of N (and ``ep``, drawn from the dp ranks, for a model with experts). Before anything is
profiled, each one is admitted or dropped here with the reason a person can act on: a degree
that does not divide what it must (heads by tp, experts by ep, the global batch by dp), more
pipeline ranks than the model has units to place, or what :meth:`ParallelDims.problems` says.
What fits memory and runs fastest is decided later, per admitted layout, by the per-layout
search (:func:`pp_core.planning.choose.choose_plan`). Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from pp_core.errors import ConfigError
from pp_core.parallel.dims import ParallelDims

__all__ = ["ModelShape", "DroppedLayout", "enumerate_layouts", "divisors", "largest_world",
           "summary"]
UNKNOWN_HEADS_TP = 512
"""The largest tp degree searched for a model whose attention heads pp-core cannot see (beyond
any machine's fast-link domain today)."""


@dataclass(frozen=True)
class ModelShape:
    """What of the model limits the degrees: units a stage can hold (``pp`` places at least
    one per rank), attention heads (``tp`` shards them), experts per MoE layer (``ep`` shards
    them; 0: no experts), and the global batch (``dp`` ranks each take an equal share)."""

    num_units: int
    num_heads: int
    num_experts: int
    global_batch_size: int
    no_tensor_parallel: str = ""  # why tp > 1 cannot shard it (no plan for the model), if so


@dataclass(frozen=True)
class DroppedLayout:
    """A layout left out before profiling, and why (one line naming the degree)."""

    dims: ParallelDims
    reason: str

    def to_dict(self) -> dict:
        return {**self.dims.to_keys(), "dropped": self.reason}


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending (``sqrt(n)`` trial divisions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def largest_world(shape: ModelShape) -> tuple[int, str]:
    """The most processes any layout of the model can use, and why: pp places at least one unit
    per rank, tp shards the attention heads, and dp ranks each take at least one sample of the
    global batch (ep is drawn from the dp ranks)."""
    if shape.no_tensor_parallel:
        tp, why = 1, f"1 ({shape.no_tensor_parallel})"
    elif shape.num_heads:
        tp, why = shape.num_heads, f"its {shape.num_heads} attention heads"
    else:
        tp, why = UNKNOWN_HEADS_TP, f"{UNKNOWN_HEADS_TP} (its attention heads are not known)"
    largest = shape.num_units * tp * shape.global_batch_size
    return largest, (f"pp_size up to its {shape.num_units} units, tp_size up to {why}, dp up to "
                     f"its global batch of {shape.global_batch_size} samples "
                     f"({shape.num_units} x {tp} x {shape.global_batch_size})")


def enumerate_layouts(world: int, shape: ModelShape,
                      fixed: Mapping[str, int] | None = None
                      ) -> tuple[list[ParallelDims], list[DroppedLayout]]:
    """``(admitted, dropped)``: every layout of ``world`` processes, pp outermost first.

    :param fixed: degrees by YAML name the user fixed (``--set distributed.tp_size=2``); a
        layout with another value is not enumerated at all.
    :raises ConfigError: ``world`` is not a positive int, or the fixed degrees cannot make it.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"--world: expected the number of processes, an int >= 1, found "
                          f"{world!r}")
    largest, why = largest_world(shape)
    if world > largest:  # refused before any factorisation: 2**60 has none to enumerate
        raise ConfigError(f"--world {world:,}: this model runs on at most {largest:,} processes: "
                          f"{why}; use a --world of at most {largest:,} (a larger "
                          f"pipeline.pp_batch_size admits more dp ranks)")
    fixed = dict(fixed or {})
    searched = ParallelDims.KEYS.values()
    unknown = sorted(set(fixed) - set(searched))
    if unknown:
        raise ConfigError(f"--world searches the degrees {', '.join(searched)}; cannot fix "
                          f"{', '.join(unknown)}")
    product = ParallelDims.from_keys(fixed).world_size  # ep is drawn from the dp ranks
    if world % product:
        written = " * ".join(f"{k}={v}" for k, v in fixed.items() if k != ParallelDims.KEYS["ep"])
        raise ConfigError(f"--world {world}: the fixed degrees {written} make {product} "
                          f"processes per layout, which does not divide {world}; drop a "
                          f"fixed degree or use a --world that {product} divides")
    admitted, dropped = [], []
    experts = shape.num_experts
    for pp in divisors(world):
        for tp in divisors(world // pp):
            dp = world // (pp * tp)
            for replicate in divisors(dp):
                for ep in (divisors(dp) if experts else [1]):
                    dims = ParallelDims(pp, replicate, dp // replicate, tp, ep)
                    if any(dims.to_keys()[k] != v for k, v in fixed.items()):
                        continue
                    reason = _reason(dims, shape)
                    if reason is None:
                        admitted.append(dims)
                    else:
                        dropped.append(DroppedLayout(dims, reason))
    if not admitted and not dropped:
        raise ConfigError(f"--world {world}: no layout has the fixed degrees "
                          f"{', '.join(f'{k}={v}' for k, v in fixed.items())}; drop one")
    return admitted, dropped


def _reason(dims: ParallelDims, shape: ModelShape) -> str | None:
    """Why the model cannot run ``dims`` (a degree that does not divide), or ``None``."""
    if dims.pp > shape.num_units:
        return (f"pp_size {dims.pp} > the model's {shape.num_units} units (every pipeline "
                f"rank holds at least one)")
    if dims.tp > 1 and shape.no_tensor_parallel:
        return f"tp_size {dims.tp}: {shape.no_tensor_parallel}"
    if shape.num_heads and shape.num_heads % dims.tp:
        return f"tp_size {dims.tp} does not divide the model's {shape.num_heads} attention heads"
    if dims.ep > 1 and shape.num_experts % dims.ep:
        return f"ep_size {dims.ep} does not divide the model's {shape.num_experts} experts"
    if shape.global_batch_size % dims.dp:
        return (f"dp {dims.dp} does not divide the global batch of "
                f"{shape.global_batch_size} samples")
    problems = dims.problems()
    return problems[0] if problems else None


SHOWN_REASONS = 3


def summary(dropped: list[DroppedLayout]) -> str:
    """Why none of ``dropped`` runs, for one line: every reason when there are few, else the
    first of each kind (the degree it names) and a count of the rest."""
    reasons = list(dict.fromkeys(d.reason for d in dropped))
    if len(reasons) <= SHOWN_REASONS:
        return ": " + "; ".join(reasons)
    kinds: dict[str, str] = {}
    for reason in reasons:
        kinds.setdefault(reason.split(" ", 1)[0], reason)
    shown = list(kinds.values())
    return (f" ({len(dropped)} factorisations dropped): {'; '.join(shown)}; and "
            f"{len(dropped) - len(shown)} more for reasons of these kinds")
