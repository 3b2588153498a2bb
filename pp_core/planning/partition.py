"""Stage-count arithmetic of a split: how many stages, and how many layers or modules each.

Pure functions of counts and weights, public for splitter authors (``pp_core_builtins.splitters``,
``pp_core_builtins.transformers``); :mod:`pp_core.planning.split` re-exports them and uses them to plan.
They raise :class:`~pp_core.ConfigError` with the offending values and the fix.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pp_core.errors import ConfigError
from pp_core.planning.balance import balance as balanced_partition  # one function, both callers

__all__ = ["spread", "spread_between", "balanced_partition", "virtual_stages"]


def spread(num_items: int, num_stages: int) -> list[int]:
    """Item counts per stage, differing by at most one; the remainder goes to interior stages.

    The first and last stages already carry the embedding and the head, so the extra layers go
    to stages ``1, 2, ..., num_stages - 2`` first, then to stage 0, then to the last stage.
    """
    if num_stages < 1 or num_items < num_stages:
        raise ConfigError(f"cannot spread {num_items} layers over {num_stages} stages with at "
                          f"least one each; use at most {num_items} stages")
    base, extra = divmod(num_items, num_stages)
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def spread_between(first: Sequence[str], layers: Sequence[str], last: Sequence[str],
                   num_stages: int) -> list[list[str]]:
    """Module names per stage for an embedding / layers / head model: ``layers`` spread over the
    stages by :func:`spread`, ``first`` put before them on stage 0, ``last`` after them on the
    last stage. The splitters of the ``layers`` contract and of HF decoders both cut this way."""
    stages, start = [], 0
    for stage, count in enumerate(spread(len(layers), num_stages)):
        fqns = list(layers[start:start + count])
        start += count
        if stage == 0:
            fqns = list(first) + fqns
        if stage == num_stages - 1:
            fqns = fqns + list(last)
        stages.append(fqns)
    return stages


def virtual_stages(
    num_layers: int,
    layers_per_stage: Optional[int],
    num_ranks: int,
    stages_per_rank: Optional[int],
    variable_stages_per_rank: bool = False,
    rounding: Optional[str] = None,
    schedule: str = "the schedule",
) -> tuple[int, int]:
    """``(num_stages, stages_per_rank)`` for a model of ``num_layers`` splittable layers.

    Without ``layers_per_stage``: ``num_ranks * stages_per_rank``. With it:
    ``ceil(num_layers / layers_per_stage)`` stages, rounded to a multiple of ``num_ranks`` when
    ``rounding`` is ``"up"``/``"down"``; the stages per rank must then equal the schedule's
    ``stages_per_rank`` unless it accepts a variable count (any value >= 2). ``None`` for
    ``stages_per_rank`` means any count is accepted. Each stage needs at least one layer.
    """
    default = stages_per_rank or 1
    if layers_per_stage is None:
        num_stages = num_ranks * default
        if num_layers < num_stages:
            raise ConfigError(
                f"model has {num_layers} layers, cannot give {num_stages} stages (num_ranks="
                f"{num_ranks} x stages_per_rank={default} for {schedule}) at least one each; keep "
                f"num_ranks x stages_per_rank <= {num_layers} (fewer ranks, or a schedule with "
                f"fewer stages per rank) or use a deeper model")
        return num_stages, default
    what = f"model has {num_layers} layers and layers_per_stage={layers_per_stage}"
    wanted = math.ceil(num_layers / layers_per_stage)
    num_stages = wanted
    if wanted % num_ranks:
        up, down = wanted + num_ranks - wanted % num_ranks, wanted - wanted % num_ranks
        if rounding == "up":
            num_stages = up
        elif rounding == "down" and down > 0:
            num_stages = down
        else:
            fixes = _layers_per_stage_fixes(num_layers, num_ranks, stages_per_rank,
                                            variable_stages_per_rank)
            hint = f"set layers_per_stage to one of {fixes}, or " if fixes else ""
            round_hint = (f"round_virtual_stages_to_pp_multiple='up' ({up} stages)"
                          + (f" or 'down' ({down} stages)" if down else ""))
            raise ConfigError(
                f"{what}, giving ceil({num_layers}/{layers_per_stage})={wanted} stages, which is "
                f"not a multiple of num_ranks={num_ranks}"
                + (" (rounding 'down' would leave 0 stages)" if rounding == "down" else "")
                + f"; {hint}set {round_hint}")
    if num_stages > num_layers:
        raise ConfigError(
            f"{what}: {num_stages} stages after rounding to a multiple of num_ranks={num_ranks}, "
            f"but {num_layers} layers cannot give {num_stages} stages at least one each; set "
            f"round_virtual_stages_to_pp_multiple='down', or use fewer ranks")
    per_rank = num_stages // num_ranks
    if stages_per_rank is not None and per_rank != stages_per_rank:
        if not variable_stages_per_rank:
            best = math.ceil(num_layers / (num_ranks * stages_per_rank))
            raise ConfigError(
                f"{what}, giving {num_stages} stages = {per_rank} per rank over num_ranks="
                f"{num_ranks}, but {schedule} runs exactly {stages_per_rank} stage(s) per rank; "
                f"set layers_per_stage={best} (or leave it unset), or pick a schedule with several "
                f"stages per rank such as 'interleaved_1f1b'")
        if per_rank < 2:
            best = max(1, num_layers // (2 * num_ranks))
            raise ConfigError(
                f"{what}, giving {num_stages} stages = {per_rank} per rank over num_ranks="
                f"{num_ranks}, but {schedule} needs at least 2 stages per rank; set "
                f"layers_per_stage={best} or lower, or use a single-stage schedule such as '1f1b'")
    return num_stages, per_rank


def _layers_per_stage_fixes(num_layers, num_ranks, stages_per_rank, variable) -> list[int]:
    found = []
    for candidate in range(1, num_layers + 1):
        stages = math.ceil(num_layers / candidate)
        if stages % num_ranks:
            continue
        per_rank = stages // num_ranks
        if stages_per_rank is None or per_rank == stages_per_rank or (variable and per_rank >= 2):
            found.append(candidate)
    return found[:6]
