"""Lowering: add the point-to-point actions a compute-only schedule implies, and buffer lifetimes.

``lower(schedule)`` turns per-rank F/B/I/W lists into per-rank *programs* that also hold
``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``. The runtime executes a program literally:

* ``RECV`` posts a non-blocking receive (``irecv``); the receive is waited right before the
  compute action that consumes it;
* ``SEND`` follows the compute that produced the data and posts a non-blocking send (``isend``),
  whose completion is waited later (at the latest at the end of the step);
* adjacent stages on the same rank (the V placement's middle pair) exchange tensors locally: no
  SEND/RECV is emitted for them.

How the order is chosen (the property NCCL needs). The programs are built by emulating the
schedule in rounds, as torch's ``_add_send_recv`` does: in each round every rank, in rank order,
emits its next compute action if its input is available (``F(s,k)`` needs ``F(s-1,k)``;
``I/B(s,k)`` needs ``I/B(s+1,k)``, or ``F(s,k)`` on the last stage); an idle step (``None``) uses
up a round. When a compute action that produces cross-rank data is emitted, its ``SEND`` is
appended to the producer's program and the matching ``RECV`` to the *current end* of the
consumer's program at the same moment. Every message therefore has one place in a single global
order, so for every pair of ranks the messages between them appear in the same order in both
programs - what NCCL's in-order matching per pair requires - and a receive is posted as early as
the emulation allows. Since every blocking wait is for data emitted earlier in that global order,
the programs cannot deadlock. torch's version rescans and pops list heads (quadratic); here a
blocked rank sleeps until the action it waits for is emitted, so lowering is linear in the number
of actions (pp=64, 2 stages per rank, 1024 microbatches: well under a second).

Receive-buffer lifetimes (what a buffer pool sizes itself from). For every ``RECV`` of a rank,
:class:`RecvLifetime` gives indices into that rank's program:

* ``posted``: the ``RECV`` itself - the buffer must exist from here;
* ``consumed``: the compute that first reads it (``F(s,k)`` for ``RECV_F(s,k)``; ``I(s,k)`` or
  ``B(s,k)`` for ``RECV_B(s,k)``);
* ``released``: the last compute that may still read it: the backward that ends ``(s,k)`` on this
  stage (``B(s,k)``, or ``W(s,k)`` when the backward is split), because autograd keeps the
  received activation (and, for split backward, the received gradient) until then.

The buffer is live on the closed interval ``[posted, released]``; two receives whose intervals
do not overlap may share memory. Lowering is pure Python and imports no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

from pp_core.errors import ScheduleError
from pp_core.schedule.acks import send_acks
from pp_core.schedule.ir import (
    B,
    F,
    I,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    W,
    Action,
    Schedule,
    format_actions,
)

__all__ = ["RecvLifetime", "RankProgram", "Program", "lower", "forward_only"]

_new_action = tuple.__new__  # Action(...) without NamedTuple.__new__'s argument parsing


class RecvLifetime(NamedTuple):
    """One receive buffer of a rank: its ``RECV`` action and three indices into the program.

    ``posted`` <= ``consumed`` <= ``released``; see the module docstring for their meaning.
    """

    action: Action
    posted: int
    consumed: int
    released: int


@dataclass(frozen=True)
class RankProgram:
    """What one rank executes: its actions in order, and its receive buffers' lifetimes.

    This is the ``program`` the ``pp_make_recv_buffer_allocator`` hook receives.
    """

    rank: int
    actions: tuple[Action, ...]
    recv_lifetimes: tuple[RecvLifetime, ...]
    stage_ranks: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == self.rank)

    def __str__(self) -> str:
        return format_actions(self.actions)


_KINDS = (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)
_CODE = {kind: index for index, kind in enumerate(_KINDS)}
_C_SEND_F, _C_RECV_F, _C_SEND_B, _C_RECV_B = 4, 5, 6, 7


class Program:
    """A lowered schedule: per-rank programs of compute and communication actions.

    Actions are stored compactly (one int each) and decoded on first access, so lowering a
    schedule of a million actions stays fast; :meth:`rank` decodes a single rank.
    """

    def __init__(self, codes, lifetimes, stage_ranks, num_microbatches: int, name: str = "custom"):
        self._codes = codes  # per rank: list of (stage * M + mb) * 8 + kind code
        self._lifetimes = lifetimes  # per rank: flat [code, posted, consumed, released, ...]
        self.stage_ranks = tuple(stage_ranks)
        self.num_microbatches = num_microbatches
        self.name = name
        self._decoded: dict[int, RankProgram] = {}

    @property
    def num_ranks(self) -> int:
        return len(self._codes)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def _decode(self, code: int) -> Action:
        key, kind = divmod(code, 8)
        stage, mb = divmod(key, self.num_microbatches)
        return _new_action(Action, (stage, _KINDS[kind], mb))

    def rank(self, rank: int) -> RankProgram:
        """The program of ``rank`` (what its executor runs)."""
        found = self._decoded.get(rank)
        if found is None:
            decode = self._decode
            actions = tuple(decode(code) for code in self._codes[rank])
            flat = self._lifetimes[rank]
            lifetimes = tuple(
                RecvLifetime(decode(flat[i]), flat[i + 1], flat[i + 2], flat[i + 3])
                for i in range(0, len(flat), 4))
            found = RankProgram(rank, actions, lifetimes, self.stage_ranks,
                                self.num_microbatches, self.name)
            self._decoded[rank] = found
        return found

    def recv_intervals(self, rank: int, grads_from_forward: bool = False):
        """``(stage, is_grad, posted, consumed, released)`` per receive of ``rank``, without
        decoding its actions: what a planner sizing thousands of programs needs.

        ``grads_from_forward``: a gradient's receive counts as posted at the forward whose
        output it is the gradient of - where the executor posts it on a backend that matches
        by tag (gloo) when buffers do not follow the program's lifetimes (no pool)."""
        flat, M = self._lifetimes[rank], self.num_microbatches
        forwards = {}
        if grads_from_forward:  # the forward of stage * M + mb, by its code (kind F is 0)
            forwards = {code >> 3: i for i, code in enumerate(self._codes[rank]) if not code & 7}
        for i in range(0, len(flat), 4):
            key, kind = divmod(flat[i], 8)
            is_grad = kind == _C_RECV_B
            posted = forwards.get(key, flat[i + 1]) if is_grad else flat[i + 1]
            yield key // M, is_grad, posted, flat[i + 2], flat[i + 3]

    def compute_positions(self, rank: int) -> list[int]:
        """Where ``rank``'s compute actions (F, B, I, W) stand in its program, in order: the
        schedule's own row, placed among the communication."""
        return [i for i, code in enumerate(self._codes[rank]) if code & 7 < 4]

    def send_acks(self, rank: int) -> dict[int, tuple[int, ...]]:
        """Where ``rank``'s sends are known received: :func:`pp_core.schedule.acks.send_acks`."""
        return send_acks(self, rank)

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Every rank's actions (decodes every rank)."""
        return tuple(self.rank(r).actions for r in range(self.num_ranks))

    @property
    def recv_lifetimes(self) -> tuple[tuple[RecvLifetime, ...], ...]:
        return tuple(self.rank(r).recv_lifetimes for r in range(self.num_ranks))

    def rows(self) -> list[str]:
        """One line per rank in the compact form, e.g. ``"0F0 0SEND_F0 0F1 ..."``."""
        return [format_actions(row) for row in self.actions]

    def __repr__(self) -> str:
        return (f"Program({self.name!r}, num_ranks={self.num_ranks}, num_stages={self.num_stages},"
                f" num_microbatches={self.num_microbatches})")


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in the same per-rank order (what evaluation runs).

    Dropping actions from a deadlock-free schedule keeps it deadlock-free.
    """
    rows = [[a for a in row if a is not None and a.kind is F] for row in schedule.actions]
    return Schedule(rows, schedule.stage_ranks, schedule.num_microbatches,
                    f"{schedule.name} (forward only)")


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
    stage_ranks = tuple(schedule.stage_ranks)
    num_stages = len(stage_ranks)
    M = schedule.num_microbatches
    num_ranks = schedule.num_ranks
    rows = [list(row) for row in schedule.actions]
    last = num_stages - 1
    # Flags per (stage, mb) key = stage * M + mb: forward emitted / input gradient emitted.
    fwd_done = bytearray(num_stages * M)
    bwd_done = bytearray(num_stages * M)
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    life: list[list[int]] = [[] for _ in range(num_ranks)]  # flat code, posted, consumed, released
    open_f: dict[int, int] = {}  # key -> offset of its RECV_F record in life[rank of stage]
    open_b: dict[int, int] = {}
    live_f: dict[int, int] = {}  # key -> offset, until the stage's last backward releases it
    live_b: dict[int, int] = {}
    waiting: dict[int, list[int]] = {}  # 2 * key (+1 for backward) -> ranks waiting for it
    ptr = [0] * num_ranks
    lengths = [len(row) for row in rows]
    current = [r for r in range(num_ranks) if lengths[r]]
    nxt: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    valid_kinds = (F, B, I, W)

    while current:
        heapq.heapify(current)
        while current:
            rank = pop(current)
            index = ptr[rank]
            action = rows[rank][index]
            if action is not None:
                try:
                    stage, kind, mb = action
                    ok = stage_ranks[stage] == rank and 0 <= mb < M and stage >= 0 \
                        and kind in valid_kinds
                except (TypeError, ValueError, IndexError):
                    ok = False
                if not ok:
                    raise _bad_action(action, rank, stage_ranks, num_stages, M)
                key = stage * M + mb
                if kind is F:
                    if stage and not fwd_done[key - M]:
                        waiting.setdefault(2 * (key - M), []).append(rank)
                        continue
                elif kind is W:
                    if not bwd_done[key]:
                        waiting.setdefault(2 * key + 1, []).append(rank)
                        continue
                elif stage == last:
                    if not fwd_done[key]:
                        waiting.setdefault(2 * key, []).append(rank)
                        continue
                elif not bwd_done[key + M]:
                    waiting.setdefault(2 * (key + M) + 1, []).append(rank)
                    continue
                row_out = out[rank]
                position = len(row_out)
                if kind is F:
                    row_out.append(key * 8)
                    fwd_done[key] = 1
                    offset = open_f.pop(key, None)
                    if offset is not None:
                        life[rank][offset + 2] = position
                    if stage != last:
                        peer = stage_ranks[stage + 1]
                        if peer != rank:
                            row_out.append(key * 8 + _C_SEND_F)
                            peer_out = out[peer]
                            peer_life = life[peer]
                            offset = len(peer_life)
                            peer_life += ((key + M) * 8 + _C_RECV_F, len(peer_out), -1, -1)
                            peer_out.append((key + M) * 8 + _C_RECV_F)
                            open_f[key + M] = offset
                            live_f[key + M] = offset
                    woken = waiting.pop(2 * key, None)
                elif kind is W:
                    row_out.append(key * 8 + 3)
                    woken = None
                else:
                    row_out.append(key * 8 + (1 if kind is B else 2))
                    bwd_done[key] = 1
                    offset = open_b.pop(key, None)
                    if offset is not None:
                        life[rank][offset + 2] = position
                    if stage > backward_from:
                        peer = stage_ranks[stage - 1]
                        if peer != rank:
                            row_out.append(key * 8 + _C_SEND_B)
                            peer_out = out[peer]
                            peer_life = life[peer]
                            offset = len(peer_life)
                            peer_life += ((key - M) * 8 + _C_RECV_B, len(peer_out), -1, -1)
                            peer_out.append((key - M) * 8 + _C_RECV_B)
                            open_b[key - M] = offset
                            live_b[key - M] = offset
                    woken = waiting.pop(2 * key + 1, None)
                if kind is not I and kind is not F:  # B or W ends (s, k): release its buffers
                    offset = live_f.pop(key, None)
                    if offset is not None:
                        life[rank][offset + 3] = position
                    offset = live_b.pop(key, None)
                    if offset is not None:
                        life[rank][offset + 3] = position
                if woken:
                    for other in woken:
                        if other > rank:
                            push(current, other)
                        else:
                            nxt.append(other)
            index += 1
            ptr[rank] = index
            if index < lengths[rank]:
                nxt.append(rank)
        current, nxt = nxt, []

    stuck = [r for r in range(num_ranks) if ptr[r] < lengths[r]]
    if stuck:
        details = "; ".join(f"rank {r} waits at {rows[r][ptr[r]]}" for r in stuck)
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot run: its dependencies form a cycle ({details}); "
            f"run validate_schedule() for the rank x step grid, and reorder the actions so each "
            f"forward follows the previous stage's forward and each backward the next stage's")
    for flat in life:
        for i in range(3, len(flat), 4):
            if flat[i] < 0:  # no backward for this (stage, mb): a forward-only program
                flat[i] = flat[i - 1]
    return Program(out, life, stage_ranks, M, schedule.name)
