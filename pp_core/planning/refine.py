"""Move the cuts of the best plans where the simulator says the step gets shorter (pure).

The cost-balanced split (:func:`pp_core.planning.balance.split_by_profile`) evens out the work
*per stage*. A rank that holds several stages (looped and V placements) is limited by their sum,
and the step by the schedule's order and the hand-offs, which a per-stage balance does not see.
So the few plans that could win are refined with the simulator itself as the objective: move one
cut by one unit at a time, keep the move that shortens the predicted step most, stop when none
does. Contiguous stages, none empty, first unit on stage 0 and last on the last stage stay true
by construction. Each step is a handful of simulations of one schedule, so refining the top plans
costs milliseconds to a fraction of a second.
"""

from __future__ import annotations

import functools
from typing import Sequence

from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.memory import stage_held_bytes, stage_sums
from pp_core.schedule.frozen import backward_from, frozen_table
from pp_core.schedule.simulate import Costs, simulate

__all__ = ["refine_counts", "makespan_of", "simulate_split", "handoff_charges",
           "optimizer_step_s", "units_of_counts"]

MAX_MOVES = 64
"""An upper bound on accepted moves (each one strictly shortens the step, so it ends anyway)."""


def units_of_counts(counts: Sequence[int]) -> list[list[int]]:
    """The units of each stage when stage ``s`` takes the next ``counts[s]`` units in order."""
    out, start = [], 0
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out


def handoff_charges(schedule, profile: ModelProfile,
                    units: Sequence[Sequence[int]]) -> list[dict[str, float]]:
    """Per stage, the time its ``F``, ``B``, ``I`` and ``W`` spend beyond the units' own compute.

    A hand-off between ranks costs both ranks time, not just latency: gloo on the CPU copies and
    frames the bytes in the sending and the receiving process, and a send can hold the rank up
    while the communication threads wait for a core. So ``F`` of a stage pays a receive of its
    input when the previous stage is on another rank and a send of its output when the next one
    is; ``B`` and ``I`` the same for the gradients the other way; ``W`` moves nothing. A hand-off between two stages of one rank (V
    placements) is a local handover and costs nothing. Every action, ``W`` too, also pays the
    executor's own time (``action_overhead_s``). Zero for a profile without those measurements.
    """
    ranks = schedule.stage_ranks
    boundary = [profile.units[u[-1]].output_bytes for u in units]
    last = len(units) - 1
    out = []
    for s in range(len(units)):
        gets = s > 0 and ranks[s - 1] != ranks[s]       # input from / gradient to stage s - 1
        gives = s < last and ranks[s + 1] != ranks[s]   # output to / gradient from stage s + 1
        forward = (profile.recv_busy_s(boundary[s - 1]) if gets else 0.0) + \
            (profile.send_busy_s(boundary[s]) if gives else 0.0)
        backward = (profile.recv_busy_s(boundary[s]) if gives else 0.0) + \
            (profile.send_busy_s(boundary[s - 1]) if gets else 0.0)
        extra = profile.action_overhead_s
        out.append({"F": forward + extra, "B": backward + extra, "I": backward + extra,
                    "W": extra})
    return out


def simulate_split(schedule, profile: ModelProfile, units: Sequence[Sequence[int]],
                   with_memory: bool = False):
    """:func:`pp_core.schedule.simulate` of ``schedule`` with ``units[i]`` on stage ``i``: per
    stage the summed unit costs plus :func:`handoff_charges`; every cross-rank hand-off charged
    the measured latency plus the largest boundary activation over the measured bandwidth on the
    dependency (simple, and pessimistic for uneven boundaries); ranks sharing fewer processors
    than there are of them (``profile.processors``) share them out; with ``with_memory`` the
    saved activations in flight too, and what a split backward holds from ``I`` to ``W``.
    With sequence slices (``schedule.seq_chunks > 1``) ``profile`` is one slice's
    (:meth:`ModelProfile.sliced`): its units' costs and bytes are a slice's."""
    sums = [stage_sums(profile, units, name)
            for name in ("forward_s", "backward_s", "input_grad_s", "weight_grad_s")]
    charges = handoff_charges(schedule, profile, units)
    rows = [[v + charges[s][k] for k, v in zip("FBIW", row)] for s, row in enumerate(zip(*sums))]
    trainable = stage_trainable_units(profile, units)  # frozen stages: less backward work
    costs = Costs(per_stage={s: dict(zip("FBIW", row))
                             for s, row in enumerate(frozen_table(rows, trainable))})
    boundary = max((profile.units[u[-1]].output_bytes for u in units[:-1]), default=0)
    activations, held = stage_held_bytes(profile, units)
    if trainable is not None:  # a frozen prefix keeps no graph; a frozen stage runs no W
        start = backward_from(trainable)
        activations = [0 if s < start else a for s, a in enumerate(activations)]
        held = [h if trainable[s] else 0 for s, h in enumerate(held)]
    memory = {"activation_bytes": activations,
              "input_grad_held_bytes": held} if with_memory else {}
    return simulate(schedule, costs, comm_latency=profile.transfer_s(boundary),
                    processors=profile.processors or None, slice_costs=True, **memory)


def optimizer_step_s(schedule, profile: ModelProfile, units) -> float:
    """The optimizer step that ends a step on its slowest rank: the bytes a rank trains (its
    stages' units) at the measured rate, and its tensors at the per-tensor one; every rank
    steps at once, so ranks sharing fewer processors (``profile.processors``) share them."""
    if not (profile.optimizer_s_per_param_byte or profile.optimizer_s_per_tensor):
        return 0.0

    def seconds(unit: UnitCost) -> float:
        return unit.trained_bytes * profile.optimizer_s_per_param_byte + \
            unit.trained_tensors * profile.optimizer_s_per_tensor

    ranks = [sum(seconds(profile.units[u]) for s in schedule.stages_of(rank) for u in units[s])
             for rank in range(schedule.num_ranks)]
    sharing = schedule.num_ranks / profile.processors if profile.processors else 1.0
    return max(ranks) * max(1.0, sharing)


def stage_trainable_units(profile: ModelProfile, units: Sequence[Sequence[int]]):
    """Per stage, whether one of its units holds something to train; ``None`` when all do."""
    flags = tuple(any(profile.units[u].trainable for u in stage) for stage in units)
    return None if all(flags) else flags


def makespan_of(schedule, profile: ModelProfile, counts: Sequence[int]) -> float:
    """The predicted step with ``counts[i]`` consecutive units on stage ``i``."""
    return simulate_split(schedule, profile, units_of_counts(counts)).makespan


def refine_counts(schedule, profile: ModelProfile, counts: Sequence[int],
                  makespan=None) -> tuple[list[int], float]:
    """Hill-climb the cuts from ``counts``; ``(best counts, their predicted step)``.
    ``makespan(counts)`` replaces :func:`makespan_of` (inf: a split that may not be taken)."""
    if makespan is None:
        makespan = functools.partial(makespan_of, schedule, profile)
    best = list(counts)
    best_time = makespan(best)
    for _ in range(MAX_MOVES):
        move = None
        for cut in range(len(best) - 1):  # the cut between stage `cut` and `cut + 1`
            for shift in (-1, 1):  # -1: a unit moves to the next stage; +1: to this one
                trial = list(best)
                trial[cut] += shift
                trial[cut + 1] -= shift
                if min(trial[cut], trial[cut + 1]) < 1:
                    continue
                seconds = makespan(trial)
                if seconds < best_time * (1 - 1e-9) and (move is None or seconds < move[1]):
                    move = (trial, seconds)
        if move is None:
            break
        best, best_time = move
    return best, best_time
