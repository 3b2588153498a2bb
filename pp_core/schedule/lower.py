"""Lowering: add the point-to-point actions a compute-only schedule implies, and buffer lifetimes.

``lower(schedule)`` turns per-rank F/B/I/W lists into per-rank *programs*
(:class:`~pp_core.schedule.program.Program`) that also hold
``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``, and the lifetime of every receive buffer. The
runtime executes a program literally:

* ``RECV`` posts a non-blocking receive (``irecv``); the receive is waited right before the
  compute action that consumes it;
* ``SEND`` follows the compute that produced the data and posts a non-blocking send (``isend``),
  whose completion is waited later (at the latest at the end of the step);
* adjacent stages on the same rank (the V placement's middle pair) exchange tensors locally: no
  SEND/RECV is emitted for them.

How the order is chosen (the property NCCL needs). The programs are built by walking the
schedule in torch's rounds (:class:`~pp_core.schedule.replay.Walk`, as torch's
``_add_send_recv`` does): in each round every rank, in rank order, emits its next compute action
if its inputs exist; an idle step (``None``) uses up a round. When a compute action that
produces cross-rank data is emitted, its ``SEND`` is appended to the producer's program and the
matching ``RECV`` to the *current end* of the consumer's program at the same moment. Every
message therefore has one place in a single global order, so for every pair of ranks the
messages between them appear in the same order in both programs - what NCCL's in-order matching
per pair requires - and a receive is posted as early as the walk allows. Since every blocking
wait is for data emitted earlier in that global order, the programs cannot deadlock. torch's
version rescans and pops list heads (quadratic); the walk is linear in the number of actions
(pp=64, 2 stages per rank, 1024 microbatches: well under a second). Lowering is pure Python and
imports no torch.
"""

from __future__ import annotations

import dataclasses

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule
from pp_core.schedule.program import Program, RankProgram, RecvLifetime
from pp_core.schedule.replay import (
    B_CODE,
    COMPUTE_CODE,
    F_CODE,
    IDLE,
    KIND_CODE,
    W_CODE,
    Dependencies,
    Walk,
    pack,
)
from pp_core.schedule.validate import validated

__all__ = ["RecvLifetime", "RankProgram", "Program", "lower", "forward_only"]  # what lower returns


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in the same per-rank order (what evaluation runs).

    Dropping actions from a deadlock-free schedule keeps it deadlock-free.
    """
    rows = [[a for a in row if a is not None and a.kind is F] for row in schedule.actions]
    return dataclasses.replace(schedule, actions=rows, name=f"{schedule.name} (forward only)")


def _bad_action(action, rank: int, stage_ranks, num_stages: int, num_microbatches: int):
    if not isinstance(action, Action):
        return ScheduleError(f"rank {rank}: {action!r} is not an Action; build actions with "
                             f"Action(stage, kind, microbatch) or parse_action('0F0')")
    stage, kind, mb = action
    if kind not in (F, B, I, W):
        return ScheduleError(f"rank {rank}: {action} is a communication action; lower() takes "
                             f"a compute-only schedule (F, B, I, W) and adds SEND/RECV itself")
    if not 0 <= stage < num_stages or not 0 <= mb < num_microbatches:
        return ScheduleError(f"rank {rank}: {action} is out of range: stages are "
                             f"0..{num_stages - 1}, microbatches 0..{num_microbatches - 1}")
    return ScheduleError(f"rank {rank}: {action} belongs to stage {stage}, which lives on rank "
                         f"{stage_ranks[stage]}; move it to that rank's row")


def lower(schedule: Schedule, backward_from: int = 0) -> Program:
    """Insert SEND/RECV for every cross-rank edge and record receive-buffer lifetimes.

    ``backward_from``: the first stage whose backward sends a gradient back is the one after it;
    the stages before it run no backward (a frozen prefix, :mod:`pp_core.schedule.frozen`), so
    no ``SEND_B``/``RECV_B`` is emitted at or below that boundary.

    :raises ScheduleError: an action on the wrong rank or out of range, a communication action
        in the input, or a schedule whose dependencies can never be met (a deadlock; the message
        names what each stuck rank waits for). Completeness (one F and one B or I+W per stage and
        microbatch) is :func:`pp_core.schedule.validate.validate_schedule`'s job.
    """
    known = validated(schedule)  # its codes, when validated as it stands, have no idle steps
    dependencies = Dependencies(schedule)
    walk = Walk(known.codes if known and not known.idle else _encode(schedule), dependencies)
    visit, out, life = _emitter(schedule, dependencies, backward_from, walk.ptr)
    walk.run(visit, one_per_turn=True)
    if walk.stuck():
        details = "; ".join(f"rank {r} waits at {schedule.actions[r][walk.ptr[r]]}"
                            for r in walk.stuck())
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot run: its dependencies form a cycle ({details}); "
            f"run validate_schedule() for the rank x step grid, and reorder the actions so each "
            f"forward follows the previous stage's forward and each backward the next stage's")
    for flat in life:
        for i in range(3, len(flat), 4):
            if flat[i] < 0:  # no backward for this (stage, mb): a forward-only program
                flat[i] = flat[i - 1]
    return Program(out, life, dependencies.stage_ranks, schedule.num_microbatches, schedule.name,
                   schedule.edges, schedule.seq_chunks)


_NOT_AN_ACTION = -2  # a row's entry lowering refuses, once the walk reaches it


def _encode(schedule: Schedule) -> list[list[int]]:
    """Each rank's row as codes (:data:`IDLE` for an idle step), without validating it: an
    entry that is no compute action of a stage on its rank is refused when the walk reaches it,
    so a schedule that cannot get there says so instead."""
    stage_ranks, M = tuple(schedule.stage_ranks), schedule.num_microbatches
    rows = []
    for rank, row in enumerate(schedule.actions):
        codes = []
        for action in row:
            if action is None:
                codes.append(IDLE)
                continue
            try:
                stage, kind, mb = action
                code = COMPUTE_CODE.get(kind)
                ok = stage_ranks[stage] == rank and 0 <= mb < M and stage >= 0 \
                    and code is not None
            except (TypeError, ValueError, IndexError):
                ok = False
            codes.append(pack(stage * M + mb, code) if ok else _NOT_AN_ACTION)
        rows.append(codes)
    return rows


def _offset(kind, to_kind, key_offset: int = 0) -> int:
    """How far the code of ``to_kind`` on the unit ``key_offset`` away lies from ``kind``'s."""
    base = 1 << 40  # any key far enough from 0 that no offset reaches below it
    return pack(base + key_offset, KIND_CODE[to_kind]) - pack(base, KIND_CODE[kind])


def _messages(dependencies: Dependencies, backward_from: int):
    """``[kind][stage]``: the messages an action sends, as ``(peer rank, key of the receiving
    unit, SEND code, RECV code)``, key and codes as offsets from the action's own: a forward's
    output to each stage after it on another rank, an input gradient to each stage before it
    that runs a backward (at or after ``backward_from``)."""
    ranks, graph, M = dependencies.stage_ranks, dependencies.graph, dependencies.num_microbatches

    def sends(stage, kind, towards, send, recv):
        peers = [s for s in towards if ranks[s] != ranks[stage]]
        if len(peers) > 1:
            raise ScheduleError(
                f"stage {stage} sends to stages {peers} on other ranks; a lowered program's "
                f"{send} names only its own stage, so lowering takes one such stage per "
                f"direction (the IR's SEND would have to name its peer)")
        return tuple((ranks[s], (s - stage) * M, _offset(kind, send),
                      _offset(kind, recv, (s - stage) * M)) for s in peers)

    forward = [sends(stage, F, after, SEND_F, RECV_F) for stage, after in enumerate(graph.after)]
    backward = [[sends(stage, kind, [s for s in before if s >= backward_from], SEND_B, RECV_B)
                 for stage, before in enumerate(graph.before)] for kind in (B, I)]
    return [forward, *backward]


def _emitter(schedule: Schedule, dependencies: Dependencies, backward_from: int,
             steps: list[int]):
    """The walk's client in :func:`lower`, and the programs it writes: each action it is handed
    goes to its rank's program, with the SEND it implies there and the matching RECV at the end
    of the peer's program (``steps``: the walk's per-rank positions)."""
    M, ranks = schedule.num_microbatches, dependencies.stage_ranks
    messages = _messages(dependencies, backward_from)
    out: list[list[int]] = [[] for _ in schedule.actions]
    life: list[list[int]] = [[] for _ in schedule.actions]  # flat code, posted, consumed, released
    units = len(ranks) * M
    # per unit, the offset of its RECV_F / RECV_B record in life[its rank] (-1: none): opened
    # until the compute that reads it, live until the unit's last backward releases it
    opened = ([-1] * units, [-1] * units)
    live = ([-1] * units, [-1] * units)

    def visit(rank: int, code: int, key: int, stage: int, kind: int) -> None:
        if code < 0:  # an idle step takes its turn; an entry that is no action stops here
            if code != IDLE:  # in rounds, steps[rank] is the step being run
                raise _bad_action(schedule.actions[rank][steps[rank]], rank, ranks, len(ranks), M)
            return
        row = out[rank]
        position = len(row)
        row.append(code)
        if kind != W_CODE:
            grad = kind != F_CODE
            reading, living = opened[grad], live[grad]
            offset = reading[key]
            if offset >= 0:  # the receive this action reads
                life[rank][offset + 2] = position
                reading[key] = -1
            for peer, delta, send, recv in messages[kind][stage]:
                row.append(code + send)
                peer_life = life[peer]
                reading[key + delta] = living[key + delta] = len(peer_life)
                peer_life += (code + recv, len(out[peer]), -1, -1)
                out[peer].append(code + recv)
        if kind == B_CODE or kind == W_CODE:  # the unit's backward ends: its buffers may go
            for living in live:
                offset = living[key]
                if offset >= 0:
                    life[rank][offset + 3] = position
                    living[key] = -1

    return visit, out, life
