"""torch's compute+comms CSV dialect: the cells beyond F/B/I/W, checked when read, written on export.

``_PipelineScheduleRuntime`` lowers a compute-only schedule into a per-rank program that also
holds these cells (``<stage><kind>[<microbatch>]``; the stage is always one of *this* rank's):

* ``3SEND_F1`` / ``4RECV_F1``: stage 3 posts the send of its output of microbatch 1; stage 4's
  rank posts the matching receive, before ``4F1`` consumes it. ``SEND_B`` / ``RECV_B`` the same
  for input gradients, towards the lower stage. Adjacent stages on one rank hand over locally:
  no cells.
* ``3WAIT_SEND_F1`` / ``3WAIT_SEND_B1`` (torch 2.15): wait for that earlier send to complete.
  2.15's runtime retires a send only there, so its validator wants exactly one wait per send,
  after the send; its lowering waits a forward send after the same stage's backward of that
  microbatch, and every other send at the end.
* ``2UNSHARD`` / ``2RESHARD``: FSDP all-gathers / frees stage 2's parameters (no-ops for a stage
  that FSDP does not manage); every compute of such a stage runs between the two.
* ``2REDUCE_GRAD``: stage 2's gradient reduction (and scaling), after its last backward.
  Torch 2.15 only starts it there and ``2WAIT_REDUCE_GRAD`` waits for it, at most one reduction
  pending per rank; before 2.15 there is no wait.

Dialects: ``"2.15"`` writes the waits, ``"2.13"`` (what 2.13 and 2.14 read) does not - those
releases' parser reads ``0WAIT_SEND_F0`` as ``0W``. When reading, a file that holds any wait
is held to 2.15's rules (one wait per send, each reduction waited), one without to the older.

pp-core runs the compute cells and re-derives its own communication by lowering; what it checks
here is that the file's communication is the consistent, deadlock-free program torch would run.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, W, Action, Schedule

__all__ = ["CommCell", "COMM_CELL_RE", "DIALECTS", "parse_comm_cell", "check_comms",
           "comms_rows", "dialect_of"]

_WITH_MB = ("WAIT_SEND_F", "WAIT_SEND_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_STAGE_ONLY = ("WAIT_REDUCE_GRAD", "REDUCE_GRAD", "UNSHARD", "RESHARD")
COMM_CELL_RE = re.compile(r"([0-9]+)(WAIT_REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|REDUCE_GRAD|"
                          r"UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)([0-9]*)")
DIALECTS = ("2.13", "2.15")
_WAITS = ("WAIT_SEND_F", "WAIT_SEND_B", "WAIT_REDUCE_GRAD")


class CommCell(NamedTuple):
    """One communication cell of a compute_comms CSV: where it stands and what it says."""

    rank: int
    column: int
    stage: int
    kind: str
    microbatch: Optional[int]

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"


def dialect_of(torch_version: str | None) -> str:
    """The dialect a torch release reads: ``"2.15"`` from 2.15 on (and for no torch at all)."""
    if torch_version is None:
        return DIALECTS[-1]
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ScheduleError(f"cannot read a torch version from {torch_version!r}; give one like "
                            f"'2.15' or '2.13.0'")
    return "2.15" if (int(match.group(1)), int(match.group(2))) >= (2, 15) else "2.13"


def parse_comm_cell(text: str, rank: int, column: int, where: str) -> CommCell | None:
    """The :class:`CommCell` of ``text``, ``None`` if it is no communication cell; a
    communication kind with a missing or superfluous microbatch is an error."""
    match = COMM_CELL_RE.fullmatch(text)
    if match is None:
        return None
    stage, kind, mb = match.groups()
    if kind in _WITH_MB and not mb:
        raise ScheduleError(f"{where}: {text!r} needs a microbatch number: "
                            f"'<stage>{kind}<microbatch>', e.g. '{stage}{kind}0'")
    if kind in _STAGE_ONLY and mb:
        raise ScheduleError(f"{where}: {text!r}: {kind} acts on a whole stage and takes no "
                            f"microbatch; write '{stage}{kind}'")
    if len(stage) > 9 or len(mb) > 9:
        raise ScheduleError(f"{where}: {text[:40]!r}: stage and microbatch numbers have at most "
                            f"9 digits")
    return CommCell(rank, column, int(stage), kind, int(mb) if mb else None)


# ----------------------------------------------------------------------------- reading

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
    strict = any(c.kind in _WAITS for c in cells)
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


# ----------------------------------------------------------------------------- writing


def comms_rows(schedule: Schedule, program, dialect: str = "2.15",
               max_active_stages: int = 3) -> list[list[str]]:
    """The rows torch's ``_PipelineScheduleRuntime._load_csv(..., format="compute_comms")``
    loads: ``program`` (:func:`~pp_core.schedule.lower.lower` of ``schedule``: its SEND/RECV
    order) with torch's own UNSHARD/RESHARD (``max_active_stages`` resident, torch's default),
    a REDUCE_GRAD after each stage's last backward and, in ``"2.15"``, the waits torch 2.15's
    lowering places (a forward send's after the same stage's backward of that microbatch, a
    reduction's right after it, every other at the end)."""
    if dialect not in DIALECTS:
        raise ScheduleError(f"unknown torch CSV dialect {dialect!r}; use one of "
                            f"{', '.join(DIALECTS)}")
    waits = dialect == "2.15"
    rows = []
    for r in range(schedule.num_ranks):
        before, at_end = _unshard_plan(schedule.compute_actions(r), max_active_stages)
        out: list[str] = []
        backwards: dict[int, int] = {}
        pending: dict[tuple, None] = {}  # sends not yet waited, in order
        reduce: list[str] = []  # a reduction due after this compute's own SEND_B
        index = 0
        for a in program.rank(r).actions:
            kind = a.kind.value
            if reduce and not (kind == "SEND_B" and a.stage == due):
                out.extend(reduce)
                reduce = []
            if a.kind in (F, B, I, W):
                out.extend(before[index])
                index += 1
            out.append(str(a))
            if kind in ("SEND_F", "SEND_B"):
                pending[(kind, a.stage, a.microbatch)] = None
                if reduce:
                    out.extend(reduce)
                    reduce = []
            sent = ("SEND_F", a.stage, a.microbatch)
            if waits and a.kind in (I, B) and sent in pending:  # the peer has consumed it
                del pending[sent]
                out.append(f"{a.stage}WAIT_SEND_F{a.microbatch}")
            if a.kind in (B, W):
                backwards[a.stage] = backwards.get(a.stage, 0) + 1
                if backwards[a.stage] == schedule.num_microbatches:
                    due = a.stage
                    reduce = [f"{a.stage}REDUCE_GRAD"] + \
                        ([f"{a.stage}WAIT_REDUCE_GRAD"] if waits else [])
        out.extend(reduce)
        out.extend(at_end)
        if waits:
            out.extend(f"{s}WAIT_{kind}{k}" for kind, s, k in pending)
        rows.append(out)
    return rows


def _unshard_plan(computes: list[Action], max_active_stages: int):
    """torch's ``_add_unshard_reshard`` for one rank: the RESHARD/UNSHARD cells before each
    compute (the next ``max_active_stages`` distinct stages resident, fetched in the order they
    compute), and the RESHARDs at the end. Walks the row backwards once for each compute's
    upcoming stages, so it is linear in the row (times the stages a rank holds)."""
    upcoming: list[list[int]] = [[] for _ in computes]
    next_use: dict[int, int] = {}
    for i in range(len(computes) - 1, -1, -1):
        next_use[computes[i].stage] = i
        upcoming[i] = sorted(next_use, key=next_use.__getitem__)[:max_active_stages]
    active: dict[int, None] = {}
    before = []
    for stages in upcoming:
        cells = [f"{s}RESHARD" for s in list(active) if s not in stages]
        for s in list(active):
            if s not in stages:
                del active[s]
        for s in stages:
            if s not in active:
                active[s] = None
                cells.append(f"{s}UNSHARD")
        before.append(cells)
    return before, [f"{s}RESHARD" for s in active]
