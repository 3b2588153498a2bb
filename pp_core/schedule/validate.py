"""Validation of compute-only schedules: placement, completeness, local order, deadlock freedom.

A schedule is data produced by plugins or read from a CSV, so everything here is a user error
raised as :class:`~pp_core.ScheduleError` (never ``assert``), naming the rank, the step (the
position in that rank's list, idle cells included, i.e. the CSV column) and the action.

The rules (``docs/schedules.md``, "Validation"):

1. every action of stage ``s`` is on ``schedule.stage_ranks[s]``;
2. every ``(stage, microbatch)`` has exactly one ``F`` and either one ``B`` or one ``I`` followed
   later by one ``W``;
3. ``F(s,k)`` needs ``F(s-1,k)``; ``I/B(s,k)`` needs ``I/B(s+1,k)`` (never a ``W``); the last
   stage's backward needs its own ``F``;
4. deadlock freedom: the walk of :mod:`pp_core.schedule.replay` (each rank runs its next action
   as soon as its inputs exist) finishes.

Everything is linear in the number of actions: one pass encodes each action as an integer
(:func:`~pp_core.schedule.replay.pack`) and checks 1-2 and local order with a per-(stage,
microbatch) bit mask, then the walk advances per-rank pointers and wakes only the ranks that
read each finished action.
"""

from __future__ import annotations

from typing import NamedTuple

from pp_core.errors import ScheduleError
from pp_core.schedule.deadlock import walk_or_raise
from pp_core.schedule.grid import format_grid  # re-exported
from pp_core.schedule.ir import B, COMM_KINDS, F, I, W, Action, Schedule
from pp_core.schedule.replay import COMPUTE_CODE, pack

__all__ = ["validate_schedule", "encode_validated", "validated", "Validated", "format_grid"]

_F_BIT, _B_BIT, _I_BIT, _W_BIT = 1, 2, 4, 8
_DONE_FULL, _DONE_SPLIT = _F_BIT | _B_BIT, _F_BIT | _I_BIT | _W_BIT
_MAX_PROBLEMS = 6


def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a complete, deadlock-free schedule."""
    encode_validated(schedule)


def encode_validated(schedule: Schedule, check_deadlock: bool = True) -> list[list[int]]:
    """Validate, and return each rank's actions (idle cells dropped) as codes
    (:mod:`pp_core.schedule.replay`'s packing; shared: read them, never change them).

    The simulator and other linear-time passes reuse this encoding instead of re-reading the
    Action tuples. With ``check_deadlock=False`` the caller runs the walk itself
    (:func:`~pp_core.schedule.deadlock.walk_or_raise`).
    """
    known = validated(schedule, check_deadlock)
    if known is not None:
        return known.codes
    _num_ranks, num_stages, num_microbatches = _check_shape(schedule)
    encoded, idle = _encode(schedule, num_stages, num_microbatches)
    if check_deadlock:
        walk_or_raise(schedule, encoded)
    schedule.__dict__["_validated"] = Validated(
        tuple(map(tuple, schedule.actions)), tuple(schedule.stage_ranks), num_microbatches,
        schedule.edges, encoded, check_deadlock, idle, schedule.seq_chunks)
    return encoded


class Validated(NamedTuple):
    """What validating a schedule found: its codes, for the passes that read it after (build,
    then simulate, lower and the planner's byte replays, each needs them), and what it was
    validated as, so a schedule changed since is validated again."""

    rows: tuple[tuple, ...]  # the actions, as validated (the references keep them)
    stage_ranks: tuple[int, ...]
    num_microbatches: int
    edges: tuple | None
    codes: list[list[int]]
    deadlock_free: bool  # the walk ran to its end (check_deadlock)
    idle: bool  # some row has idle steps, which the codes leave out
    seq_chunks: int = 1


def validated(schedule: Schedule, deadlock_free: bool = False) -> Validated | None:
    """What validating ``schedule`` found, if it has not changed since (and its walk ran to its
    end, with ``deadlock_free``); ``None``: it must be validated (again)."""
    known = schedule.__dict__.get("_validated")
    if known is None or (deadlock_free and not known.deadlock_free):
        return None
    actions = schedule.actions
    same = known.num_microbatches == schedule.num_microbatches and \
        known.edges == schedule.edges and known.seq_chunks == schedule.seq_chunks and \
        known.stage_ranks == tuple(schedule.stage_ranks) and \
        isinstance(actions, (list, tuple)) and len(actions) == len(known.rows) and \
        all(isinstance(row, (list, tuple)) and tuple(row) == was
            for row, was in zip(actions, known.rows))
    return known if same else None


# ----------------------------------------------------------------------------- shape


def _check_shape(schedule: Schedule) -> tuple[int, int, int]:
    actions = schedule.actions
    if not isinstance(actions, (list, tuple)) or not actions:
        raise ScheduleError(f"schedule {schedule.name!r} has no ranks; actions must be one list "
                            f"of actions per rank")
    num_ranks = len(actions)
    for r, row in enumerate(actions):
        if not isinstance(row, (list, tuple)):
            raise ScheduleError(f"schedule {schedule.name!r}: rank {r}'s actions are a "
                                f"{type(row).__name__}, expected a list of actions")
    num_stages = len(schedule.stage_ranks)
    if num_stages == 0:
        raise ScheduleError(f"schedule {schedule.name!r} has no stages (stage_ranks is empty)")
    for s, r in enumerate(schedule.stage_ranks):
        if not isinstance(r, int) or not 0 <= r < num_ranks:
            raise ScheduleError(
                f"schedule {schedule.name!r}: stage {s} is placed on rank {r!r}, but the schedule "
                f"has {num_ranks} ranks (0..{num_ranks - 1})")
    empty = sorted(set(range(num_ranks)) - set(schedule.stage_ranks))
    if empty:
        raise ScheduleError(
            f"schedule {schedule.name!r}: rank(s) {', '.join(map(str, empty))} hold no stage; "
            f"every rank needs at least one stage (num_stages={num_stages}, num_ranks={num_ranks})")
    num_microbatches = schedule.num_microbatches
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(f"schedule {schedule.name!r}: num_microbatches must be an int >= 1, "
                            f"got {num_microbatches!r}")
    chunks = schedule.seq_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or \
            num_microbatches % chunks:
        raise ScheduleError(f"schedule {schedule.name!r}: seq_chunks={chunks!r} must be an int "
                            f">= 1 that divides num_microbatches={num_microbatches} (the units: "
                            f"microbatches times slices)")
    return num_ranks, num_stages, num_microbatches


# ----------------------------------------------------------------------------- pass 1


def _encode(schedule: Schedule, num_stages: int,
            num_microbatches: int) -> tuple[list[list[int]], bool]:
    """Check placement, ranges, duplicates and local order; return per-rank codes, and
    whether any row has idle steps (which the codes leave out)."""
    stage_ranks = schedule.stage_ranks
    M = num_microbatches
    state = bytearray(num_stages * M)
    kind_code, code_of = COMPUTE_CODE, pack
    encoded: list[list[int]] = []
    idle = False
    for r, row in enumerate(schedule.actions):
        enc: list[int] = []
        append = enc.append
        for step, action in enumerate(row):
            if action is None:
                idle = True
                continue
            if type(action) is not Action:
                _bad_item(schedule, r, step, action)
            s, kind, mb = action
            kc = kind_code.get(kind)
            if kc is None or type(s) is not int or type(mb) is not int:
                _bad_item(schedule, r, step, action)
            if not (0 <= s < num_stages and 0 <= mb < M) or stage_ranks[s] != r:
                _bad_place(schedule, r, step, action, num_stages, M)
            key = s * M + mb
            st = state[key]
            if kc == 0:
                if st:
                    _local_order(schedule, r, step, action, st)
                state[key] = _F_BIT
            elif kc == 3:
                if st != _F_BIT | _I_BIT:
                    _local_order(schedule, r, step, action, st)
                state[key] = _DONE_SPLIT
            else:
                if st != _F_BIT:
                    _local_order(schedule, r, step, action, st)
                state[key] = _DONE_FULL if kc == 1 else _F_BIT | _I_BIT
            append(code_of(key, kc))
        encoded.append(enc)
    if state.count(_DONE_FULL) + state.count(_DONE_SPLIT) != len(state):
        _incomplete(schedule, state, M)
    return encoded, idle


def _bad_item(schedule: Schedule, r: int, step: int, action) -> None:
    where = f"schedule {schedule.name!r}, rank {r} step {step}"
    kind = getattr(action, "kind", None) if isinstance(action, tuple) else None
    if kind in COMM_KINDS:
        raise ScheduleError(
            f"{where}: {action} is a communication action, but a compute-only schedule holds only "
            f"F/B/I/W; sends and receives are added by lowering (pp_core.schedule.lower) — drop "
            f"the comm actions (pp_core.schedule.csv_io.read_csv drops them from torch's "
            f"compute_comms files)")
    raise ScheduleError(
        f"{where}: expected an Action(stage, kind, microbatch) with kind F/B/I/W or None (idle), "
        f"got {action!r}; build actions with pp_core.Action or pp_core.schedule.parse_action")


def _bad_place(schedule, r, step, action, num_stages, M) -> None:
    s, _kind, mb = action
    where = f"schedule {schedule.name!r}, rank {r} step {step}: {action}"
    if not isinstance(s, int) or not 0 <= s < num_stages:
        raise ScheduleError(f"{where} names stage {s!r}, but the schedule has {num_stages} stages "
                            f"(0..{num_stages - 1})")
    if not isinstance(mb, int) or not 0 <= mb < M:
        hint = f"set num_microbatches={mb + 1} or " if isinstance(mb, int) and mb >= M else ""
        raise ScheduleError(f"{where} names microbatch {mb!r}, but the schedule has {M} "
                            f"microbatches (0..{M - 1}); {hint}fix the action")
    owner = schedule.stage_ranks[s]
    raise ScheduleError(
        f"{where}: stage {s} is placed on rank {owner}, so its actions must all be on rank "
        f"{owner}; each stage lives on exactly one rank (stage_ranks={list(schedule.stage_ranks)})")


def _local_order(schedule: Schedule, r: int, step: int, action: Action, st: int) -> None:
    s, kind, mb = action
    where = f"schedule {schedule.name!r}, rank {r} step {step}: {action}"
    earlier = _find_step(schedule, r, step, s, mb)
    if kind == F:
        if st & _F_BIT:
            reason = (f"is a second forward of stage {s} microbatch {mb} (the first is at "
                      f"{earlier})")
        else:
            reason = f"comes after the backward at {earlier}; F must come before I/B"
    elif kind == W:
        if st & _W_BIT:
            reason = f"is a second W of stage {s} microbatch {mb} (the first is at {earlier})"
        elif st & _B_BIT:
            reason = (f"follows the full backward {s}B{mb} at {earlier}; a W belongs only after an "
                      f"I (B already computes the weight gradients)")
        elif not st & _F_BIT:
            reason = f"comes before {s}F{mb} and {s}I{mb}; the order must be F, then I, then W"
        else:
            reason = f"comes before {s}I{mb}; W (weight grads) must follow its I (input grads)"
    else:
        if not st & _F_BIT and earlier == "no step":
            reason = f"has no forward {s}F{mb} before it (rank {r} never runs {s}F{mb})"
        elif not st & _F_BIT:
            reason = f"comes before its forward {s}F{mb} at {earlier}; F must come before I/B"
        else:
            reason = (f"is a second backward of stage {s} microbatch {mb} (the first is at "
                      f"{earlier}); use either one B or one I plus one W")
    raise ScheduleError(f"{where} {reason}\n{format_grid(schedule, {(r, step)})}")


def _find_step(schedule: Schedule, r: int, before: int, s: int, mb: int) -> str:
    row = schedule.actions[r]
    for step in range(before):
        a = row[step]
        if a is not None and a[0] == s and a[2] == mb:
            return f"step {step} ({a})"
    for step in range(before + 1, len(row)):
        a = row[step]
        if a is not None and a[0] == s and a[2] == mb:
            return f"step {step} ({a})"
    return "no step"


def _incomplete(schedule: Schedule, state: bytearray, M: int) -> None:
    problems = []
    total = 0
    for key, st in enumerate(state):
        if st == _DONE_FULL or st == _DONE_SPLIT:
            continue
        total += 1
        if len(problems) >= _MAX_PROBLEMS:
            continue
        s, mb = divmod(key, M)
        rank = schedule.stage_ranks[s]
        if not st & _F_BIT:
            what = f"{s}F{mb} (forward) and its backward are missing" if not st else \
                f"{s}F{mb} (forward) is missing"
        elif st & _I_BIT:
            what = f"{s}W{mb} is missing (every I needs a later W on the same rank)"
        else:
            what = f"the backward is missing (add {s}B{mb}, or {s}I{mb} then {s}W{mb})"
        problems.append(f"stage {s} microbatch {mb} (rank {rank}): {what}")
    more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
    raise ScheduleError(
        f"schedule {schedule.name!r} is incomplete: {total} (stage, microbatch) pair(s) lack "
        f"actions; every pair needs one F and either one B or one I followed by one W "
        f"(num_stages={len(schedule.stage_ranks)}, num_microbatches={M})\n  "
        + "\n  ".join(problems) + more)
