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

pp-core runs the compute cells and re-derives its own communication by lowering; the file's
communication is checked when read (:mod:`pp_core.schedule.torch_comms_check`), written here.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from pp_core.errors import ScheduleError, quoted
from pp_core.schedule.ir import B, F, I, W, Action, Schedule

__all__ = ["CommCell", "COMM_CELL_RE", "DIALECTS", "WAIT_KINDS", "TORCH_RELEASES", "parse_comm_cell",
           "comms_rows", "dialect_of", "release_dialect"]

_WITH_MB = ("WAIT_SEND_F", "WAIT_SEND_B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_STAGE_ONLY = ("WAIT_REDUCE_GRAD", "REDUCE_GRAD", "UNSHARD", "RESHARD")
COMM_CELL_RE = re.compile(r"([0-9]+)(WAIT_REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|REDUCE_GRAD|"
                          r"UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)([0-9]*)")
DIALECTS = ("2.13", "2.15")
TORCH_RELEASES = ("2.13", "2.14", "2.15")
"""The torch releases pp-core supports (pyproject's ``torch>=2.13,<2.16``)."""
_RELEASE_RE = re.compile(r"(\d{1,4})\.(\d{1,4})(?:\.\d{1,4})?(?:(?:a|b|rc)\d{1,4}|\.dev\d{1,12})?"
                         r"(?:\+[0-9A-Za-z.]{1,40})?", re.ASCII)
WAIT_KINDS = ("WAIT_SEND_F", "WAIT_SEND_B", "WAIT_REDUCE_GRAD")


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


def release_dialect(text: str) -> str:
    """The dialect of a torch release a user names (``--torch``): strictly a version string of
    a supported release (``2.15``, ``2.13.0``, ``2.15.0+cpu``), else a ScheduleError."""
    supported = f"pp-core supports torch {', '.join(TORCH_RELEASES[:-1])} and {TORCH_RELEASES[-1]}"
    match = _RELEASE_RE.fullmatch(text)
    if match is None:
        raise ScheduleError(f"--torch {quoted(text)}: expected a torch release such as 2.15 or "
                            f"2.13.0 ({supported})")
    release = f"{int(match.group(1))}.{int(match.group(2))}"
    if release not in TORCH_RELEASES:
        raise ScheduleError(f"--torch {text}: {supported}; give the release that will load the "
                            f"file")
    return dialect_of(release)


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
