"""A torch compute+comms file's communication checked as it is read: every send paired with its
receive in order, each wait where torch's validator wants it, and no deadlock
(the cells and dialects: :mod:`pp_core.schedule.torch_comms`).

pp-core runs the compute cells and re-derives its own communication by lowering; what it checks
here is that the file's communication is the consistent, deadlock-free program torch would run.
"""

from __future__ import annotations

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, Action, Schedule
from pp_core.schedule.torch_comms import WAIT_KINDS, CommCell

__all__ = ["check_comms"]

_TOWARDS = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1, "WAIT_SEND_F": 1,
            "WAIT_SEND_B": -1}
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
        towards = cell.stage + _TOWARDS[cell.kind]
        if not 0 <= towards < num_stages:
            fail(cell, f"has no stage {towards} to talk to; remove it")
        if ranks[towards] == cell.rank:
            fail(cell, f"talks to stage {towards} on the same rank, which torch hands over "
                       f"locally (no cell); remove it")
    _check_order(cells, compute_col, fail)
    _check_pairs(cells, schedule, at, where)
    _check_waits(cells, at, fail)
    _check_deadlock(cells, schedule, columns, at, where)


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


def _check_pairs(cells, schedule: Schedule, at, where: str) -> None:
    """With any SEND/RECV cell in the file, every hand-off between ranks has both."""
    if not any(c.kind in _P2P for c in cells):
        return
    ranks = schedule.stage_ranks
    for r, row in enumerate(schedule.actions):
        for a in row:
            if a is None:
                continue
            s, k = a.stage, a.microbatch
            if a.kind is F and s + 1 < len(ranks) and ranks[s + 1] != r:
                pair = (("SEND_F", s), ("RECV_F", s + 1))
            elif a.kind in (I, B) and s > 0 and ranks[s - 1] != r:
                pair = (("SEND_B", s), ("RECV_B", s - 1))
            else:
                continue
            for kind, stage in pair:
                if (kind, stage, k) not in at:
                    raise ScheduleError(
                        f"{where}: {a} on rank {r} hands off to stage {pair[1][1]} on rank "
                        f"{ranks[pair[1][1]]}, but row {ranks[stage]} has no '{stage}{kind}{k}'; "
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


def _needs(item, r: int, ranks, at) -> tuple | None:
    """The send or receive (``(kind, stage, microbatch)``) that ``item`` blocks on in torch's
    runtime: a compute fed from another rank, the peer's send; a send's wait, the peer's
    receive. Everything else posts and moves on."""
    if isinstance(item, Action):
        s, k = item.stage, item.microbatch
        if item.kind is F and s > 0 and ranks[s - 1] != r:
            need = ("SEND_F", s - 1, k)
        elif item.kind in (I, B) and s + 1 < len(ranks) and ranks[s + 1] != r:
            need = ("SEND_B", s + 1, k)
        else:
            return None
        return need if need in at else None
    if item.kind in ("WAIT_SEND_F", "WAIT_SEND_B"):
        return ("RECV" + item.kind[9:], item.stage + _TOWARDS[item.kind], item.microbatch)
    return None


def _check_deadlock(cells, schedule: Schedule, columns, at, where: str) -> None:
    """Run the rows as torch's runtime would (:func:`_needs`); rows left blocked with nothing
    to unblock them are a deadlock, named cell by cell. Linear: a blocked row sleeps until
    what it waits for is posted."""
    ranks = schedule.stage_ranks
    rows: list[list] = []
    for r, row in enumerate(schedule.actions):
        items = [(col, a) for a, col in zip(row, columns[r]) if a is not None]
        items += [(c.column, c) for c in cells if c.rank == r]
        rows.append(sorted(items, key=lambda pair: pair[0]))
    posted: set = set()
    pointer = [0] * len(rows)
    waiting: dict[tuple, list[int]] = {}
    runnable = list(range(len(rows)))
    while runnable:
        r = runnable.pop()
        while pointer[r] < len(rows[r]):
            item = rows[r][pointer[r]][1]
            need = _needs(item, r, ranks, at)
            if need is not None and need not in posted:
                waiting.setdefault(need, []).append(r)
                break
            pointer[r] += 1
            if isinstance(item, CommCell) and item.kind in _P2P:
                key = (item.kind, item.stage, item.microbatch)
                posted.add(key)
                runnable.extend(waiting.pop(key, ()))
    stuck = [r for r in range(len(rows)) if pointer[r] < len(rows[r])]
    if stuck:
        lines = []
        for r in stuck:
            col, item = rows[r][pointer[r]]
            kind, stage, mb = need = _needs(item, r, ranks, at)
            lines.append(f"  rank {r} column {col}: {item} waits for '{stage}{kind}{mb}' "
                         f"(row {at[need].rank}, column {at[need].column}), not reached")
        raise ScheduleError(f"{where}: its communication deadlocks in torch's runtime:\n"
                            + "\n".join(lines) + "\nmove each send (or receive) before the "
                            "cells that wait for its peer")
