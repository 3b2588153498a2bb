"""How large a schedule pp-core builds: every path that builds one is bounded before it starts.

A schedule holds a forward and a backward action per stage and microbatch, and building,
validating, simulating and lowering it costs time and memory in proportion (a
``--microbatches 100000000`` simulation once grew past 24 GB). :func:`size_problem` says why
sizes are refused, naming the limit and the flag or key the caller knows them by; the YAML
path (:mod:`pp_core.app.spec`), :func:`~pp_core.schedule.build.build_schedule` and the
schedule commands all use it. The limits are far beyond any real step.
"""

from __future__ import annotations

__all__ = ["MAX_MICROBATCHES", "MAX_RANKS", "MAX_STAGES_PER_RANK", "MAX_CELLS", "size_problem"]

MAX_MICROBATCHES = 16_384
"""Microbatches per step (100,000 took 35 s to validate; 10**9 never finished)."""

MAX_RANKS = 4_096
"""Pipeline ranks: beyond the largest pipeline-parallel degree anyone runs."""

MAX_STAGES_PER_RANK = 256
"""Stages (virtual pipeline chunks) per rank."""

MAX_CELLS = 1 << 19
"""Stages x microbatches: each pair is one F and one B (or I and W) action of the schedule."""

_NAMES = {"num_ranks": "num_ranks", "stages_per_rank": "stages_per_rank",
          "num_microbatches": "num_microbatches"}


def size_problem(num_ranks: int, stages_per_rank: int | None, num_microbatches: int,
                 names: dict[str, str] | None = None) -> str | None:
    """Why a schedule of these sizes is not built (``None``: it is); ``names`` maps
    ``num_ranks`` / ``stages_per_rank`` / ``num_microbatches`` to the caller's words (flags)."""
    said = {**_NAMES, **(names or {})}
    for what, value, limit in (("num_ranks", num_ranks, MAX_RANKS),
                               ("stages_per_rank", stages_per_rank, MAX_STAGES_PER_RANK),
                               ("num_microbatches", num_microbatches, MAX_MICROBATCHES)):
        if isinstance(value, int) and value > limit:
            return (f"{said[what]}={value:,} is more than pp-core's limit of {limit:,}; use a "
                    f"smaller {said[what]}")
    stages = num_ranks * (stages_per_rank or 1)
    if isinstance(stages, int) and isinstance(num_microbatches, int) and \
            stages * num_microbatches > MAX_CELLS:
        v = f" x {said['stages_per_rank']}={stages_per_rank:,}" if stages_per_rank else ""
        return (f"{said['num_ranks']}={num_ranks:,}{v} stages x "
                f"{said['num_microbatches']}={num_microbatches:,} microbatches = "
                f"{stages * num_microbatches:,} (stage, microbatch) pairs, more than pp-core's "
                f"limit of {MAX_CELLS:,} per schedule (each is a forward and a backward "
                f"action); use fewer microbatches or stages")
    return None
