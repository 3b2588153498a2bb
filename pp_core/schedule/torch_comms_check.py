"""A torch compute+comms file's communication checked as it is read: every send paired with its
receive in order, each wait where torch's validator wants it, and no deadlock
(the cells and dialects: :mod:`pp_core.schedule.torch_comms`).

pp-core runs the compute cells and re-derives its own communication by lowering; what it checks
here is that the file's communication is the consistent, deadlock-free program torch would run.
"""

from __future__ import annotations

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, Action, Schedule
from pp_core.schedule.replay import StageGraph, Walk, pack, stage_graph
from pp_core.schedule.torch_comms import WAIT_KINDS, CommCell

__all__ = ["check_comms"]

_TOWARDS = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1, "WAIT_SEND_F": 1,
            "WAIT_SEND_B": -1}
"""Whom a cell talks to: the stage after its own (1) or before it (-1) in the stage graph."""
_CONSUMER = {"RECV_F": ("F",), "RECV_B": ("I", "B")}
_PRODUCER = {"SEND_F": ("F",), "SEND_B": ("I", "B")}
_P2P = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def check_comms(cells: list[CommCell], schedule: Schedule, columns: list[list[int]],
                where: str) -> None:
    """Refuse communication cells that torch's runtime would fail on or hang at.

    ``schedule`` holds the file's compute cells (already validated); ``columns[r][i]`` is the CSV
    column of ``schedule.actions[r][i]``.
    """
    ranks, num_stages, m = schedule.stage_ranks, schedule.num_stages, schedule.num_microbatches
    graph = stage_graph(num_stages, schedule.edges, schedule.name)
    at: dict[tuple, CommCell] = {}  # (kind, stage, microbatch) -> its cell
    compute_col: dict[tuple, int] = {}  # (kind letter, stage, microbatch) -> its column
    for r, row in enumerate(schedule.actions):
        for a, col in zip(row, columns[r]):
            if a is not None:
                compute_col[(a.kind.value, a.stage, a.microbatch)] = col

    def fail(cell: CommCell, why: str) -> None:
        raise ScheduleError(f"{where}, row {cell.rank} (rank {cell.rank}), column {cell.column}: "
                            f"{str(cell)!r} {why}")

    for cell in cells:
        if cell.stage >= num_stages or ranks[cell.stage] != cell.rank:
            home = f"lives on rank {ranks[cell.stage]}" if cell.stage < num_stages else \
                f"does not exist (stages 0..{num_stages - 1})"
            fail(cell, f"names stage {cell.stage}, which {home}; a rank's cells name its own "
                       f"stages")
        if cell.microbatch is not None and cell.microbatch >= m:
            fail(cell, f"names microbatch {cell.microbatch}, but the schedule has {m} "
                       f"(0..{m - 1})")
        if cell.kind not in _TOWARDS:
            continue
        key = (cell.kind, cell.stage, cell.microbatch)
        if key in at:
            fail(cell, f"appears twice (also column {at[key].column}); torch posts each send, "
                       f"receive and wait once")
        at[key] = cell
        towards = _peer(graph, cell)
        if towards is None:
            fail(cell, f"has no stage {cell.stage + _TOWARDS[cell.kind]} to talk to; remove it")
        if ranks[towards] == cell.rank:
            fail(cell, f"talks to stage {towards} on the same rank, which torch hands over "
                       f"locally (no cell); remove it")
    _check_order(cells, compute_col, fail)
    _check_pairs(cells, schedule, graph, at, where)
    _check_waits(cells, at, fail)
    _check_deadlock(cells, schedule, graph, columns, at, where)


def _peer(graph: StageGraph, cell: CommCell) -> int | None:
    """The stage ``cell`` talks to (``None``: there is none)."""
    found = (graph.after if _TOWARDS[cell.kind] > 0 else graph.before)[cell.stage]
    return found[0] if found else None


def _check_order(cells, compute_col, fail) -> None:
    """Each send after the compute that produced it, each receive before its consumer, each
    reduction after the stage's last backward, UNSHARD/RESHARD around the stage's computes."""
    for cell in cells:
        s, k = cell.stage, cell.microbatch
        names = _PRODUCER.get(cell.kind) or _CONSUMER.get(cell.kind)
        if names is None:
            continue
        found = [(compute_col[(n, s, k)], n) for n in names if (n, s, k) in compute_col]
        if not found:
            continue  # a missing compute is the compute validator's message
        col, name = found[0]
        if cell.kind in _PRODUCER and cell.column < col:
            fail(cell, f"comes before {s}{name}{k} (column {col}), which computes what it "
                       f"sends; move it after that cell")
        if cell.kind in _CONSUMER and cell.column > col:
            fail(cell, f"comes after {s}{name}{k} (column {col}), which consumes what it "
                       f"receives; move it before that cell")
    for cell in cells:
        if cell.kind == "REDUCE_GRAD":
            last = max((col for (n, s, _), col in compute_col.items()
                        if s == cell.stage and n in ("B", "W")), default=-1)
            if cell.column < last:
                fail(cell, f"comes before a backward of stage {cell.stage} (column {last}); a "
                           f"gradient reduction follows the stage's last backward")
    for stage in sorted({c.stage for c in cells if c.kind in ("UNSHARD", "RESHARD")}):
        marks = sorted((c for c in cells if c.stage == stage and c.kind in ("UNSHARD", "RESHARD")),
                       key=lambda c: c.column)
        for i, cell in enumerate(marks):
            if cell.kind != ("UNSHARD", "RESHARD")[i % 2]:
                fail(cell, "is out of turn: a stage's UNSHARD and RESHARD cells alternate, "
                           "UNSHARD first")
        if marks[-1].kind == "UNSHARD":
            fail(marks[-1], "is never followed by its RESHARD; add one after the stage's last "
                            "compute")
        for (n, s, k), col in compute_col.items():
            if s == stage and not any(u.column < col < v.column
                                      for u, v in zip(marks[::2], marks[1::2])):
                fail(marks[0], f"and its RESHARD leave {s}{n}{k} (column {col}) outside; torch "
                               f"computes on an FSDP stage only between UNSHARD and RESHARD")


def _check_pairs(cells, schedule: Schedule, graph: StageGraph, at, where: str) -> None:
    """With any SEND/RECV cell in the file, every hand-off between ranks has both."""
    if not any(c.kind in _P2P for c in cells):
        return
    ranks = schedule.stage_ranks
    for r, row in enumerate(schedule.actions):
        for a in row:
            if a is None:
                continue
            s, k = a.stage, a.microbatch
            if a.kind is F:
                peers, send, recv = graph.after[s], "SEND_F", "RECV_F"
            elif a.kind in (I, B):
                peers, send, recv = graph.before[s], "SEND_B", "RECV_B"
            else:
                continue
            for peer in (t for t in peers if ranks[t] != r):
                for kind, stage in ((send, s), (recv, peer)):
                    if (kind, stage, k) not in at:
                        raise ScheduleError(
                            f"{where}: {a} on rank {r} hands off to stage {peer} on rank "
                            f"{ranks[peer]}, but row {ranks[stage]} has no '{stage}{kind}{k}'; "
                            f"a compute_comms file holds every send and receive (or write it "
                            f"compute-only and let lowering add them)")


def _check_waits(cells, at, fail) -> None:
    """Each wait after its send (or reduction); with any wait in the file (torch 2.15's
    dialect), one per send and per reduction, and at most one reduction pending per rank."""
    strict = any(c.kind in WAIT_KINDS for c in cells)
    for cell in cells:
        if cell.kind in ("WAIT_SEND_F", "WAIT_SEND_B"):
            send = at.get((cell.kind[5:], cell.stage, cell.microbatch))
            if send is None or send.column > cell.column:
                fail(cell, f"waits for '{cell.stage}{cell.kind[5:]}{cell.microbatch}', which "
                           f"does not come before it in this row; a wait follows its send")
        elif strict and cell.kind in ("SEND_F", "SEND_B") and \
                ("WAIT_" + cell.kind, cell.stage, cell.microbatch) not in at:
            fail(cell, f"has no '{cell.stage}WAIT_{cell.kind}{cell.microbatch}' after it; in "
                       f"torch 2.15's dialect (this file has waits) every send has one wait")
    pending: dict[int, CommCell] = {}
    for cell in sorted(cells, key=lambda c: (c.rank, c.column)):
        if cell.kind == "REDUCE_GRAD":
            if strict and cell.rank in pending:
                fail(cell, f"starts while stage {pending[cell.rank].stage}'s reduction is "
                           f"pending; torch 2.15 keeps one pending per rank: add "
                           f"'{pending[cell.rank].stage}WAIT_REDUCE_GRAD' before it")
            pending[cell.rank] = cell
        elif cell.kind == "WAIT_REDUCE_GRAD":
            started = pending.pop(cell.rank, None)
            if started is None or started.stage != cell.stage:
                fail(cell, f"has no pending '{cell.stage}REDUCE_GRAD' before it in this row; a "
                           f"wait follows its reduction")
    if strict:
        for cell in pending.values():
            fail(cell, f"is never waited; in torch 2.15's dialect add "
                       f"'{cell.stage}WAIT_REDUCE_GRAD' after it")


def _needs(item, r: int, graph: StageGraph, ranks, at) -> list[tuple]:
    """The sends or receives (``(kind, stage, microbatch)``) that ``item`` blocks on in torch's
    runtime: a compute fed from another rank, the peer's send; a send's wait, the peer's
    receive. Everything else posts and moves on."""
    if isinstance(item, Action):
        s, k = item.stage, item.microbatch
        if item.kind is F:
            needs = [("SEND_F", t, k) for t in graph.before[s] if ranks[t] != r]
        elif item.kind in (I, B):
            needs = [("SEND_B", t, k) for t in graph.after[s] if ranks[t] != r]
        else:
            return []
        return [need for need in needs if need in at]
    if item.kind in ("WAIT_SEND_F", "WAIT_SEND_B"):
        return [("RECV" + item.kind[9:], _peer(graph, item), item.microbatch)]
    return []


class _Posting:
    """torch's runtime as tables for :class:`~pp_core.schedule.replay.Walk`: each cell of the
    file is a unit of its own (its number the key, one microbatch), waiting for the cells
    :func:`_needs` names; a SEND or RECV cell, once passed, is posted for them."""

    num_microbatches = 1

    def __init__(self, rows, graph: StageGraph, ranks, at):
        self.needs = [[_needs(item, r, graph, ranks, at) for _, item in row]
                      for r, row in enumerate(rows)]
        numbers, number = {}, 0  # (kind, stage, microbatch) of a SEND/RECV -> its cell's number
        self.codes = []
        for row in rows:
            self.codes.append([pack(number + i, 0) for i in range(len(row))])
            numbers.update({(item.kind, item.stage, item.microbatch): number + i
                            for i, (_, item) in enumerate(row)
                            if isinstance(item, CommCell) and item.kind in _P2P})
            number += len(row)
        self.counts = [len(needs) for row in self.needs for needs in row]
        self.wakes = [[[] for _ in range(number)]]  # indexed [kind 0][cell number]
        waiter = 0
        for r, row in enumerate(self.needs):
            for needs in row:
                for need in needs:
                    if need in numbers:
                        self.wakes[0][numbers[need]].append((8 * (waiter - numbers[need]), r))
                waiter += 1

    def missing(self) -> list[int]:
        return [n if kind == 0 else 0 for n in self.counts for kind in range(8)]


def _check_deadlock(cells, schedule: Schedule, graph: StageGraph, columns, at,
                    where: str) -> None:
    """Run the rows as torch's runtime would (:func:`_needs`); rows left blocked with nothing
    to unblock them are a deadlock, named cell by cell."""
    ranks = schedule.stage_ranks
    rows: list[list] = []
    for r, row in enumerate(schedule.actions):
        items = [(col, a) for a, col in zip(row, columns[r]) if a is not None]
        items += [(c.column, c) for c in cells if c.rank == r]
        rows.append(sorted(items, key=lambda pair: pair[0]))
    posting = _Posting(rows, graph, ranks, at)
    walk = Walk(posting.codes, posting)
    walk.run()
    if not walk.stuck():
        return
    lines = []
    for r in walk.stuck():
        col, item = rows[r][walk.ptr[r]]
        kind, stage, mb = need = posting.needs[r][walk.ptr[r]][0]
        lines.append(f"  rank {r} column {col}: {item} waits for '{stage}{kind}{mb}' "
                     f"(row {at[need].rank}, column {at[need].column}), not reached")
    raise ScheduleError(f"{where}: its communication deadlocks in torch's runtime:\n"
                        + "\n".join(lines) + "\nmove each send (or receive) before the "
                        "cells that wait for its peer")
