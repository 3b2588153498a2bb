"""Peak bytes of saved activations per rank, replayed from a schedule's own order (no clock).

An F saves its stage's activations until the B (or, with a split backward, the W) of the same
microbatch; a split backward's I holds ``input_grad_held_bytes`` until its W. :func:`simulate
<pp_core.schedule.simulate.simulate>` reports the same figure beside its timings; a planner that
tries many byte figures on one schedule calls :func:`peak_activation_bytes` alone.
"""

from __future__ import annotations

from typing import Sequence

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import Schedule
from pp_core.schedule.replay import F_CODE, I_CODE, W_CODE, columns
from pp_core.schedule.validate import encode_validated

__all__ = ["peak_activation_bytes", "rank_peak_bytes", "bytes_per_stage"]


def peak_activation_bytes(schedule: Schedule, activation_bytes: Sequence[float],
                          input_grad_held_bytes: Sequence[float] | None = None,
                          encoded: list[list[int]] | None = None,
                          transient_bytes: Sequence[float] | None = None,
                          floor: Sequence[Sequence[float]] | None = None) -> list[float]:
    """Per rank, the ``peak_activation_bytes`` of :func:`simulate` without the timing replay
    (the bytes follow each rank's own order, not the clock): what a planner that tries many
    byte figures on one schedule calls. ``encoded``: the schedule's
    :func:`~pp_core.schedule.validate.encode_validated` rows, to skip encoding again.
    ``transient_bytes`` (per stage): the temporaries a stage's actions hold while they run (a
    checkpointed block's recomputed activations), counted on top of what is live when each of
    its ``B``, ``I`` or ``W`` starts and each ``F`` ends - not on top of the rank's peak, which
    may come where they are not. ``floor`` (per rank, per compute action of its row): bytes
    held beside the activations while that action runs (receive buffers, sent gradients),
    counted there."""
    held = bytes_per_stage(input_grad_held_bytes, schedule.num_stages, "input_grad_held_bytes")
    stage_bytes = bytes_per_stage(activation_bytes, schedule.num_stages)
    transient = bytes_per_stage(transient_bytes, schedule.num_stages, "transient_bytes")
    if encoded is None:
        encoded = encode_validated(schedule, check_deadlock=False)
    return [rank_peak_bytes(row, schedule.num_microbatches, stage_bytes, held, transient,
                            None if floor is None else floor[rank])
            for rank, row in enumerate(encoded)]


def rank_peak_bytes(row, M: int, stage_bytes: list[float], held: list[float] | None,
                    transient: list[float] | None = None,
                    floor: Sequence[float] | None = None) -> float:
    """The most bytes one rank's saved activations (and split-backward holdings, and with
    ``transient`` each action's temporaries while it runs, and with ``floor`` what else each
    action has beside them) reach."""
    if floor is not None:
        return _floored_peak_bytes(row, M, stage_bytes, held, transient, floor)
    live_b = peak_b = 0.0
    for stage, kc in zip(*columns(row, M)):
        if transient is not None and kc != F_CODE and live_b + transient[stage] > peak_b:
            peak_b = live_b + transient[stage]
        if kc == F_CODE:
            live_b += stage_bytes[stage]
            if live_b > peak_b:
                peak_b = live_b
            if transient is not None and live_b + transient[stage] > peak_b:
                peak_b = live_b + transient[stage]  # its forward's, on what it saved
        elif kc != I_CODE:
            if held is not None:  # what the I before it left, not seen at an F yet
                if live_b > peak_b:
                    peak_b = live_b
                if kc == W_CODE:
                    live_b -= held[stage]
            live_b -= stage_bytes[stage]
        elif held is not None:  # the state before it: while it runs its own additions
            if live_b > peak_b:  # are among its temporaries (the memory model's transient),
                peak_b = live_b  # after it they are counted here
            live_b += held[stage]
    return peak_b


def _floored_peak_bytes(row, M: int, stage_bytes, held, transient, floor) -> float:
    """:func:`rank_peak_bytes` with ``floor[i]`` held beside everything while action ``i``
    runs (its own loop: the plain one is the planner's inner loop)."""
    live_b = peak_b = 0.0
    for stage, kc, beside in zip(*columns(row, M), floor):
        extra = beside + (transient[stage] if transient is not None else 0.0)
        if kc == F_CODE:
            peak_b = max(peak_b, live_b + beside)  # what it reads is there before it saves
            live_b += stage_bytes[stage]
            peak_b = max(peak_b, live_b + extra)
        elif kc != I_CODE:
            peak_b = max(peak_b, live_b + extra)
            if kc == W_CODE and held is not None:
                live_b -= held[stage]
            live_b -= stage_bytes[stage]
        else:
            peak_b = max(peak_b, live_b + extra)
            if held is not None:
                live_b += held[stage]
    return peak_b


def bytes_per_stage(activation_bytes, num_stages: int,
                    name: str = "activation_bytes") -> list[float] | None:
    if activation_bytes is None:
        return None
    if isinstance(activation_bytes, (int, float)) and not isinstance(activation_bytes, bool):
        return [float(activation_bytes)] * num_stages
    values = list(activation_bytes)
    if len(values) != num_stages:
        raise ScheduleError(f"{name} has {len(values)} entries; give one per stage "
                            f"({num_stages}) or a single number for every stage")
    return [float(v) for v in values]
