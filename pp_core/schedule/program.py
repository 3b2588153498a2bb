"""A lowered schedule: each rank's program of compute and communication actions, and the
lifetimes of its receive buffers (what :func:`pp_core.schedule.lower.lower` returns).

Receive-buffer lifetimes (what a buffer pool sizes itself from). For every ``RECV`` of a rank,
:class:`RecvLifetime` gives indices into that rank's program:

* ``posted``: the ``RECV`` itself - the buffer must exist from here;
* ``consumed``: the compute that first reads it (``F(s,k)`` for ``RECV_F(s,k)``; ``I(s,k)`` or
  ``B(s,k)`` for ``RECV_B(s,k)``);
* ``released``: the last compute that may still read it: the backward that ends ``(s,k)`` on this
  stage (``B(s,k)``, or ``W(s,k)`` when the backward is split), because autograd keeps the
  received activation (and, for split backward, the received gradient) until then.

The buffer is live on the closed interval ``[posted, released]``; two receives whose intervals
do not overlap may share memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pp_core.schedule.acks import send_acks
from pp_core.schedule.ir import RECV_B, Action, format_actions
from pp_core.schedule.replay import F_CODE, KIND_CODE, W_CODE, columns, decode, pack, unpack

__all__ = ["RecvLifetime", "RankProgram", "Program"]


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
    seq_chunks: int = 1
    """Sequence slices per microbatch: ``num_microbatches`` counts units, slice ``u % K`` of
    microbatch ``u // K`` (:class:`~pp_core.schedule.ir.Schedule`)."""

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == self.rank)

    def __str__(self) -> str:
        return format_actions(self.actions)


class Program:
    """A lowered schedule: per-rank programs of compute and communication actions.

    Actions are stored compactly (one int each) and decoded on first access, so lowering a
    schedule of a million actions stays fast; :meth:`rank` decodes a single rank.
    """

    def __init__(self, codes, lifetimes, stage_ranks, num_microbatches: int, name: str = "custom",
                 edges=None, seq_chunks: int = 1):
        self._codes = codes  # per rank: the codes of its actions (pp_core.schedule.replay)
        self._lifetimes = lifetimes  # per rank: flat [code, posted, consumed, released, ...]
        self.stage_ranks = tuple(stage_ranks)
        self.num_microbatches = num_microbatches
        self.name = name
        self.edges = edges  # the schedule's stage graph (None: the chain)
        self.seq_chunks = seq_chunks  # sequence slices per microbatch (units = mb x slices)
        self._decoded: dict[int, RankProgram] = {}

    @property
    def num_ranks(self) -> int:
        return len(self._codes)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def _decode(self, code: int) -> Action:
        return decode(code, self.num_microbatches)

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
                                self.num_microbatches, self.name, self.seq_chunks)
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
        if grads_from_forward:  # the forward of each unit, by its code
            codes = self._codes[rank]
            forwards = {code: i for i, (code, kind) in enumerate(zip(codes, columns(codes, M)[1]))
                        if kind == F_CODE}
        for i in range(0, len(flat), 4):
            key, kind = unpack(flat[i])
            is_grad = kind == KIND_CODE[RECV_B]
            posted = forwards.get(pack(key, F_CODE), flat[i + 1]) if is_grad else flat[i + 1]
            yield key // M, is_grad, posted, flat[i + 2], flat[i + 3]

    def compute_positions(self, rank: int) -> list[int]:
        """Where ``rank``'s compute actions (F, B, I, W) stand in its program, in order: the
        schedule's own row, placed among the communication."""
        kinds = columns(self._codes[rank], self.num_microbatches)[1]
        return [i for i, kind in enumerate(kinds) if kind <= W_CODE]

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
