"""Cut a row of costed units into contiguous stages so that the slowest stage is as fast as can be.

A pipeline runs at the pace of its slowest stage, so the split to want minimises the maximum
stage cost. One function serves both callers: the ``sequential`` splitter balances integer
parameter counts, the ``balanced`` splitter measured seconds. It is exact for floats too: the
optimal bound is always the cost of some contiguous run of units, so the binary search runs over
those candidate sums (computed from one array of prefix sums, the same numbers the feasibility
check compares, so no rounding can make the optimum look infeasible; the result is optimal up to
the rounding of float sums).

:func:`split_by_profile` turns a :class:`~pp_core.planning.costs.ModelProfile` into module names
per stage. Pure: no torch.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Optional, Sequence

from pp_core.errors import ConfigError

__all__ = ["balance", "split_by_profile", "unit_costs", "stage_fqns", "KINDS"]

KINDS = ("train", "eval")
"""What a unit's cost is: ``train`` forward + full backward (F+B), ``eval`` forward only."""


def balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous unit counts per stage minimising the heaviest stage (every stage non-empty).

    Among equally good splits the earlier stages are filled first (a left-to-right greedy fill
    at the optimal bound), so a costless unit stays with the unit before it.
    """
    num_items = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages={num_stages!r} must be a positive int")
    if num_items < num_stages:
        raise ConfigError(f"cannot split {num_items} units into {num_stages} non-empty stages; "
                          f"use at most {num_items} stages")
    bad = [c for c in costs if isinstance(c, bool) or not isinstance(c, (int, float))
           or not math.isfinite(c) or c < 0]
    if bad:
        raise ConfigError(f"unit costs must be finite numbers >= 0, got {bad[:4]} in "
                          f"{list(costs)[:12]}")
    prefix = [0, *accumulate(costs)]

    def fill(bound) -> Optional[list[int]]:
        counts, start = [], 0
        for index in range(num_items):
            stages_left = num_stages - len(counts)
            over = prefix[index + 1] - prefix[start] > bound
            if index > start and (over or num_items - index < stages_left):
                counts.append(index - start)
                start = index
                if len(counts) >= num_stages:
                    return None
            if prefix[index + 1] - prefix[start] > bound:
                return None
        counts.append(num_items - start)
        return counts if len(counts) == num_stages else None

    candidates = sorted({prefix[b] - prefix[a]
                         for a in range(num_items) for b in range(a + 1, num_items + 1)})
    low, high = 0, len(candidates) - 1  # fill(the whole sum) always succeeds
    while low < high:
        mid = (low + high) // 2
        if fill(candidates[mid]) is None:
            low = mid + 1
        else:
            high = mid
    return fill(candidates[low])


def unit_costs(profile, kind: str = "train") -> list[float]:
    """Seconds per unit that :func:`split_by_profile` balances (see :data:`KINDS`)."""
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r}: expected one of {', '.join(map(repr, KINDS))}")
    if kind == "eval":
        return [u.forward_s for u in profile.units]
    return [u.forward_s + u.backward_s for u in profile.units]


def split_by_profile(profile, num_stages: int, kind: str = "train") -> list[list[str]]:
    """Module names per stage, balancing measured time (:func:`unit_costs`) per stage.

    Stages are in stage order (the schedule's stage indices; which rank holds which stage - V
    placement, loops - is the schedule's business), so the first unit (the embedding) is on
    stage 0 and the last (head and loss) on the last stage by construction. Transfers are not
    in the cost: every cut between blocks hands on the same hidden state, so they cost the same
    whichever blocks a stage holds. The lists have the form of ``module_fqns_per_model_part``:
    parameter-free modules every stage needs (``profile.shared_fqns``, a rotary table) are not
    in them; the splitter that builds the parts adds them (``fqn``, ``hf_decoder``, ``balanced``).
    """
    units = profile.units
    if not units:
        raise ConfigError("the profile has no units; profile the model with "
                          "pp_core.measure.profile.profile_model first")
    counts = balance(unit_costs(profile, kind), num_stages)
    return stage_fqns([unit.fqns for unit in units], counts)


def stage_fqns(units, counts, shared=()) -> list[list[str]]:
    """Module names per stage: ``counts[i]`` consecutive units each, ``shared`` on every stage."""
    if sum(counts) != len(units):
        raise ConfigError(f"stage unit counts {list(counts)} add up to {sum(counts)}, but there "
                          f"are {len(units)} units")
    stages, start = [], 0
    for count in counts:
        fqns = [fqn for unit in units[start:start + count] for fqn in unit]
        stages.append(fqns + [fqn for fqn in shared if fqn not in fqns])
        start += count
    return stages
