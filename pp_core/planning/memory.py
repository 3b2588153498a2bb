"""Predicted peak memory of each rank for one plan, from a profile and the schedule (pure).

Why a model and not a measurement: the planner has to reject a plan *before* it runs, for every
schedule x stages per rank x microbatch size, in well under a second each. The parts:

* **parameters, gradients, optimizer state** of the rank's stages: ``param_bytes`` of their units,
  the same again for gradients, ``optimizer_bytes_per_param_byte`` times it for the optimizer
  (AdamW: two moments, 2.0);
* **activations in flight**: the schedule's own order decides how many microbatches' saved
  tensors (and, on a stage that is not the last, its outputs, kept for its backward) a rank
  holds at once. :func:`pp_core.schedule.simulate` replays the per-rank order
  (the same compute order the lowered program runs) with one stage-microbatch's saved bytes per
  stage and reports the peak per rank;
* **what a split backward holds from I to W** (:func:`split_held_bytes`): ``I`` keeps, for
  ``W`` to restart from, the gradients at the nodes where a parameter's side branches off the
  input path (a block's attention and MLP projections, a head's logits) and a view of the
  gradient of each unit's output; ``W`` frees them. The profiler measures both per unit
  (``input_grad_held_bytes``, ``output_grad_held_bytes``) and the replay adds them at each
  ``I`` and takes them back at its ``W`` (up to 1.37x under-predicted without it);
* **receive buffers**: every ``RECV`` of the lowered program needs a buffer set the size of the
  message: a stage's input (``RECV_F``: the previous stage's boundary activation) or the gradient
  of its output (``RECV_B``: the same size as its boundary activation). Without the pool a
  received input lives until the backward that releases it and a received gradient until the
  ``B`` or ``I`` that consumes it (what a split backward's ``W`` still holds of it is in the
  part above, pool or not), and the replay counts them beside the activations action by action
  (:func:`recv_bytes_per_action`): the buffers of each kind peak at other moments than the
  activations and than each other (their maxima summed were 1.13x the live tensors of a looped
  schedule, once the runtime stopped holding sent tensors to the step's end). A received input
  that the stage's first unit saves for backward is one tensor, counted with the activations
  from its forward on (:func:`kept_input_bytes`). With the pool every message lives only until
  it is consumed, plus the spare sets (the interval colouring of
  :mod:`pp_core.schedule.buffer_plan`), allocated for the whole step;
* **sent gradients** until the rank knows them received (:func:`sent_bytes_per_action`).

* **transients**: one action runs at a time on a rank, so on top of the above it holds the
  temporaries of one unit's forward + backward (``transient_bytes``, measured by the profiler:
  a vocabulary head's logits, log-softmax and their gradients; a checkpointed block's
  recomputed activations). The byte replay adds each stage's largest at the start of each of
  its ``B``/``I`` (:func:`layered_peaks`): the peak with AC on some stages only comes
  where the stages that do not recompute hold the most, not where a recompute runs.

* **the optimizer step's temporaries**: ``step()`` runs after the last backward, when the
  activations are gone (pooled receive buffers stay), so it competes with them rather than adding
  to them: ``optimizer_step_bytes_per_param_byte`` times the rank's parameters (AdamW with
  ``foreach``: 1.0, measured, tests/measure/test_transient.py; the for-loop form holds three times
  its largest parameter).

What it leaves out (and so under-predicts by): the allocator's caching and fragmentation, and the
input batch itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from pp_core.planning.costs import ALL_INPUT, ModelProfile
from pp_core.schedule.buffer_plan import max_live
from pp_core.schedule.ir import SEND_B, Schedule
from pp_core.schedule.lower import lower
from pp_core.schedule import peak_bytes  # a module: predict_memory's parameter has its name
from pp_core.schedule.validate import encode_validated

__all__ = ["RankMemory", "predict_memory", "pooled_recv_bytes", "recv_bytes_per_action",
           "sent_bytes_per_action", "kept_input_bytes", "add_floors", "split_held_bytes",
           "stage_held_bytes", "posts_receives_early", "stage_transients", "layered_peaks"]


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted peak, in bytes, part by part."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    recv_default: int   # what receive buffers add to the peak without the pool (held as the
                        # runtime holds them, counted where they are live with the rest)
    recv_pool: int      # with the receive-buffer pool (``pp_recv_buffer_pool: true``)
    transient: int = 0  # what its backwards' temporaries add on top of ``activations``
    optimizer_step: int = 0  # the optimizer step's temporaries
    sent: int = 0       # what sent gradients, held until known received, add on top of those

    def total(self, pool: bool) -> int:
        """The larger of the two peaks: during the forwards and backwards, or during the step
        (which comes after them, with only the pooled receive buffers still held)."""
        recv = self.recv_pool if pool else self.recv_default
        running = self.activations + recv + self.transient + self.sent
        stepping = (self.recv_pool if pool else 0) + self.optimizer_step
        return self.params + self.grads + self.optimizer + max(running, stepping)

    def to_dict(self, pool: bool) -> dict:
        return {"rank": self.rank, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "activations": self.activations,
                "transient": self.transient, "sent": self.sent,
                "optimizer_step": self.optimizer_step,
                "recv_buffers": self.recv_pool if pool else self.recv_default,
                "recv_buffers_without_pool": self.recv_default,
                "recv_buffers_with_pool": self.recv_pool, "total": self.total(pool)}


def stage_sums(profile: ModelProfile, units_per_stage: Sequence[Sequence[int]], field: str):
    """Per stage, the sum of ``field`` over its units."""
    return [sum(getattr(profile.units[u], field) for u in units) for units in units_per_stage]


def boundary_bytes(profile: ModelProfile, units_per_stage: Sequence[Sequence[int]]) -> list[int]:
    """Per stage, the bytes it hands to the next one: its last unit's output."""
    return [profile.units[units[-1]].output_bytes for units in units_per_stage]


def split_held_bytes(profile: ModelProfile,
                     units_per_stage: Sequence[Sequence[int]]) -> list[int]:
    """Per stage, the bytes a split backward's ``I`` adds and its ``W`` frees.

    A stage holds, per unit, what its ``I`` kept and what its ``W`` keeps of the gradient of the
    unit's output: inside the stage the one the next unit handed back, at its end the received
    one (a receive buffer's or the pool's copy, held here rather than as a buffer); less what
    dies at ``I`` above its last unit's topmost boundary (nothing but ``W`` holds it). The first
    stage has no differentiable input: its ``I`` does nothing and its ``W`` runs the whole
    backward with the received gradient (the size of its boundary activation).
    """
    out = []
    for stage, units in enumerate(units_per_stage):
        if stage == 0:
            last = len(units_per_stage) == 1
            out.append(0 if last else profile.units[units[-1]].output_bytes)
        else:
            out.append(sum(profile.units[u].input_grad_held_bytes
                           + profile.units[u].output_grad_held_bytes for u in units)
                       - profile.units[units[-1]].input_grad_freed_bytes)
    return out


def stage_held_bytes(profile: ModelProfile,
                     units_per_stage: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per stage, ``(what one microbatch holds from its F, what a split backward's I adds and
    its W frees)``: the units' saved activations and :func:`split_held_bytes`, plus the outputs
    a stage that is not the last keeps for its backward (the executor's ``state.outputs``: the
    receiver has its own copy) - until its ``B``, or its ``I`` when the backward is split.
    Under activation checkpointing they are as large as what a block keeps (1.1-1.3x low
    without them)."""
    saved = stage_sums(profile, units_per_stage, "activation_bytes")
    held = split_held_bytes(profile, units_per_stage)
    for stage, units in enumerate(units_per_stage[:-1]):
        outputs = profile.units[units[-1]].output_bytes
        saved[stage] += outputs
        held[stage] -= outputs
    return saved, held


def pooled_recv_bytes(schedule: Schedule, boundary: Sequence[int], slack: int,
                      program=None) -> list[int]:
    """Per rank, the receive-buffer pool's bytes: the pool copies a message out where it is
    consumed, so a class (stage, input or gradient) needs as many sets as receives live on
    ``[posted, consumed]``, plus ``slack`` spare sets, for the whole step. (Without the pool the
    buffers are counted action by action: :func:`recv_bytes_per_action`.)"""
    program = lower(schedule) if program is None else program
    pooled = [0] * schedule.num_ranks
    for rank in range(schedule.num_ranks):
        copied: dict[tuple[int, bool], list] = {}
        for stage, is_grad, posted, consumed, _ in program.recv_intervals(rank):
            copied.setdefault((stage, is_grad), []).append((posted, consumed))
        for (stage, is_grad), intervals in copied.items():
            size = boundary[stage] if is_grad else boundary[stage - 1]
            pooled[rank] += (max_live(intervals) + slack) * size
    return pooled


def recv_bytes_per_action(schedule: Schedule, boundary: Sequence[int], program=None,
                          early: bool = False,
                          kept: Sequence[int] | None = None) -> list[list[int]]:
    """Per rank, per compute action of its row (the replay's ``floor``), the bytes of the
    receive buffers live while it runs, without the pool: every message gets a fresh tensor,
    from the action after its ``RECV`` through the action that releases it (a gradient: that
    consumes it; what ``W`` keeps of it is :func:`split_held_bytes`). ``early``
    (:func:`posts_receives_early`): a gradient's from the forward whose output it is for (up
    to 1.16x under-predicted on rank 0 of a looped schedule without it), and every input's
    from the step's start (``transfers.prepost_forward``, on every step after
    the first: 8 inputs from the start on a middle rank at 8 microbatches, 1.09-1.11x its
    prediction before). ``kept`` (per stage): the bytes of a received input that the stage's
    saved activations already count after its forward (:func:`kept_input_bytes`); they are
    counted here only up to that forward."""
    program = lower(schedule) if program is None else program
    out = []
    for rank in range(schedule.num_ranks):
        computes = program.compute_positions(rank)
        change = [0] * (len(computes) + 1)
        for stage, is_grad, posted, consumed, released in program.recv_intervals(rank, early):
            size = boundary[stage] if is_grad else boundary[stage - 1]
            if early and not is_grad:
                posted = -1
            change[bisect.bisect_right(computes, posted)] += size
            if is_grad:
                change[bisect.bisect_right(computes, consumed)] -= size
            else:
                saved = min(size, kept[stage]) if kept else 0
                change[bisect.bisect_right(computes, consumed)] -= saved
                change[bisect.bisect_right(computes, released)] -= size - saved
        out.append(running_sums(change))
    return out


def kept_input_bytes(profile: ModelProfile, units_per_stage: Sequence[Sequence[int]],
                     keeps: Sequence[int] | None = None) -> list[int]:
    """Per stage, what its first unit keeps of its input for backward (``saved_input_bytes``,
    or ``keeps``'s entry; ``ALL_INPUT``: all of it), at most the input's size: on a stage
    after the first that input is the received buffer, to be counted once (counted twice,
    1.1x over the live tensors of a looped schedule)."""
    if keeps is None:
        keeps = [profile.units[units[0]].saved_input_bytes for units in units_per_stage]
    out = [0]
    for stage in range(1, len(units_per_stage)):
        size = profile.units[units_per_stage[stage - 1][-1]].output_bytes
        out.append(size if keeps[stage] == ALL_INPUT else min(size, keeps[stage]))
    return out


def sent_bytes_per_action(schedule: Schedule, boundary: Sequence[int],
                          program=None) -> list[list[int]]:
    """Per rank, per compute action of its row, the bytes of the gradients it has sent and
    still holds: a stage's input gradient is the mailbox's alone once sent, until the rank
    knows it received (:meth:`~pp_core.schedule.lower.Program.send_acks`: the upstream rank's
    next message after its backward) or the step ends. (A sent output is the stage's own,
    counted with its activations until its backward, where its gradient proves it received.)
    At the live peak of the last rank of dfs on 2 ranks, 4 microbatches, its mailbox held
    three of them (96 KiB, 6 % of the rank's tensors)."""
    program = lower(schedule) if program is None else program
    out = []
    for rank in range(schedule.num_ranks):
        computes = program.compute_positions(rank)
        acked = {send: at for at, sends in program.send_acks(rank).items() for send in sends}
        change = [0] * (len(computes) + 1)
        for position, action in enumerate(program.rank(rank).actions):
            if action.kind is SEND_B:
                size = boundary[action.stage - 1]
                change[bisect.bisect_right(computes, position)] += size
                end = acked.get(position)
                if end is not None:
                    change[bisect.bisect_right(computes, end)] -= size
        out.append(running_sums(change))
    return out


def add_floors(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """Per rank, per action, ``a`` + ``b``."""
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def running_sums(change: list[int]) -> list[int]:
    """The value at each index of a difference array (its last entry is past the end)."""
    live, out = 0, []
    for delta in change[:-1]:
        live += delta
        out.append(live)
    return out


def posts_receives_early(profile: ModelProfile) -> bool:
    """Whether the runtime posts receives ahead of their ``RECV`` (without the pool): on a
    backend that matches messages by tag, gloo, which is what pp-core runs on the CPU
    (:mod:`pp_core.runtime.executor`, ``early_receives``): a gradient's at the forward whose
    output it is for, every input's at the step's start."""
    return profile.device.startswith("cpu")


def predict_memory(profile: ModelProfile, schedule: Schedule,
                   units_per_stage: Sequence[Sequence[int]], peak_activation_bytes: Sequence[float],
                   slack: int = 2, program=None) -> list[RankMemory]:
    """Every rank's :class:`RankMemory` for this split and schedule.

    :param peak_activation_bytes: per rank, from ``simulate(..., activation_bytes=...)``.
    :param program: ``lower(schedule)``, when the caller has it already.
    """
    params = stage_sums(profile, units_per_stage, "param_bytes")
    trained = stage_sums(profile, units_per_stage, "trained_bytes")  # frozen: no grad, no state
    program = lower(schedule) if program is None else program
    pooled = pooled_recv_bytes(schedule, boundary_bytes(profile, units_per_stage), slack,
                               program)
    extra, sends, default = layered_peaks(profile, schedule, units_per_stage, program,
                                          posts_receives_early(profile))
    out = []
    for rank in range(schedule.num_ranks):
        p = sum(params[s] for s in schedule.stages_of(rank))
        t = sum(trained[s] for s in schedule.stages_of(rank))
        out.append(RankMemory(
            rank=rank, params=p, grads=t,
            optimizer=int(t * profile.optimizer_bytes_per_param_byte),
            optimizer_step=int(t * profile.optimizer_step_bytes_per_param_byte),
            activations=int(peak_activation_bytes[rank]),
            recv_default=default[rank], recv_pool=pooled[rank],
            transient=extra[rank], sent=sends[rank]))
    return out


def stage_transients(profile: ModelProfile, units_per_stage: Sequence[Sequence[int]]):
    """Per stage, the largest ``transient_bytes`` of its units."""
    return [max((profile.units[u].transient_bytes for u in units), default=0)
            for units in units_per_stage]


def layered_peaks(profile: ModelProfile, schedule: Schedule,
                  units_per_stage: Sequence[Sequence[int]], program,
                  early: bool) -> tuple[list[int], list[int], list[int]]:
    """Per rank, what each part adds to the activation peak on top of the ones before it,
    where they are live together: ``(transients, sent gradients, receive buffers without the
    pool)``. A stage's largest transient counts on top of what is live when one of its
    ``B``/``I`` starts - not the rank's largest on top of its peak: a stage holding many
    microbatches without recomputation peaks where a recomputing stage's large transient is
    not (that sum was up to 1.3x over the live tensors)."""
    boundary = boundary_bytes(profile, units_per_stage)
    saved, held = stage_held_bytes(profile, units_per_stage)
    transients = stage_transients(profile, units_per_stage)
    sent = sent_bytes_per_action(schedule, boundary, program)
    received = recv_bytes_per_action(schedule, boundary, program, early,
                                     kept_input_bytes(profile, units_per_stage))
    encoded = encode_validated(schedule, check_deadlock=False)  # once for the four replays
    peaks = [peak_bytes.peak_activation_bytes(schedule, saved, held, encoded, *extra)
             for extra in ((), (transients,), (transients, sent),
                           (transients, add_floors(sent, received)))]
    return tuple([int(max(0, a - b)) for a, b in zip(upper, lower_)]
                 for lower_, upper in zip(peaks, peaks[1:]))
