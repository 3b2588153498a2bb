"""Read and write schedules in torch's CSV format (``_PipelineScheduleRuntime._load_csv``).

One row per rank (row index = rank), one cell per step: ``<stage><F|B|I|W><microbatch>``, an
empty cell is an idle step. Written with :mod:`csv` defaults (comma, CRLF), exactly like
torch's ``_dump_csv``, so torch reads what pp-core writes and vice versa.

Reading also accepts what torch *dumps*:

* ``compute_comms`` files (torch's default dump format), torch 2.15's included: their
  ``SEND_F/RECV_F/SEND_B/RECV_B``, ``WAIT_SEND_F/WAIT_SEND_B``, ``UNSHARD/RESHARD`` and
  ``REDUCE_GRAD/WAIT_REDUCE_GRAD`` cells are checked with the meaning torch gives them (each
  on its own stage's row, sends after their compute and matched by receives, one wait per send
  in 2.15's dialect, no deadlock: :mod:`pp_core.schedule.torch_comms`), then dropped - pp-core's
  lowering re-derives them;
* ``(a;b)OVERLAP_F_B`` cells (torch's DualPipeV): split into ``a`` then ``b``, which is how
  torch runs them when no overlap function is registered.

Unlike torch's ``_Action.from_str``, cells are parsed strictly (``0F1junk`` and ``0F`` are
errors), and every error names the row (rank), the column and the reason.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Literal

from pp_core.errors import ScheduleError, ScheduleFileNotFoundError, quoted, shorten
from pp_core.schedule.ir import COMPUTE_KINDS, Schedule, parse_action
from pp_core.schedule.lower import lower
from pp_core.schedule.replay import chain
from pp_core.schedule.torch_comms import CommCell, comms_rows, parse_comm_cell
from pp_core.schedule.torch_comms_check import check_comms
from pp_core.schedule.validate import validate_schedule

__all__ = ["read_csv", "parse_csv", "write_csv", "format_csv", "format_comms_csv",
           "installed_torch_version"]

Format = Literal["auto", "compute_only", "compute_comms"]
_OVERLAP_RE = re.compile(r"\((.*)\)OVERLAP_F_B")
_FORMATS = ("auto", "compute_only", "compute_comms")


def read_csv(path_or_text: str | os.PathLike, format: Format = "auto",
             validate: bool = True) -> Schedule:
    """A validated :class:`Schedule` from a CSV file, or from CSV text.

    A :class:`~pathlib.Path`, or a string naming an existing file, is read as a file; any other
    string containing a comma or a newline is parsed as CSV text.

    :param format: ``"compute_only"`` rejects communication cells (torch's ``compute_only``);
        ``"compute_comms"`` and ``"auto"`` drop them.
    """
    if isinstance(path_or_text, os.PathLike) or (
            isinstance(path_or_text, str) and "\n" not in path_or_text
            and ("," not in path_or_text or os.path.exists(path_or_text))):
        path = Path(path_or_text)
        if not path.is_file():
            raise ScheduleFileNotFoundError(f"schedule CSV {quoted(str(path))} does not exist "
                                            f"(or is not a file)")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[:exc.start].count(b"\n") + 1
            raise ScheduleError(f"schedule CSV {quoted(str(path))}, line {line}: byte "
                                f"0x{data[exc.start]:02x} is not UTF-8 text; a schedule CSV is "
                                f"text such as '0F0,0B0' (is it a CSV file?)") from None
        return parse_csv(text, format=format, name=path.stem, source=str(path),
                         validate=validate)
    if not isinstance(path_or_text, str):
        raise ScheduleError(f"read_csv takes a path or CSV text, got {type(path_or_text).__name__}")
    return parse_csv(path_or_text, format=format, validate=validate)


def parse_csv(text: str, format: Format = "auto", name: str = "csv", source: str | None = None,
              validate: bool = True) -> Schedule:
    """Parse CSV text (see :func:`read_csv`); ``source`` names it in error messages."""
    if format not in _FORMATS:
        raise ScheduleError(f"unknown CSV format {format!r}; use one of {', '.join(_FORMATS)}")
    where = f"schedule CSV {quoted(source)}" if source else "schedule CSV"
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark (editors on Windows write one)
    if "\x00" in text:
        raise ScheduleError(f"{where} holds NUL bytes: a binary file, not CSV text")
    actions, columns, comms, split = [], [], [], 0
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise ScheduleError(f"{where}: not CSV text ({shorten(str(exc), 200)})") from None
    for rank, row in enumerate(rows):
        rank_actions, rank_columns = [], []
        for column, cell in enumerate(row):
            at = f"{where}, row {rank} (rank {rank}), column {column}"
            parsed = _parse_cell(cell, format, at, rank, column)
            if isinstance(parsed, CommCell):
                comms.append(parsed)
                continue
            parsed = [None] if parsed is None else parsed
            rank_actions.extend(parsed)
            rank_columns.extend([column] * len(parsed))
            split += len(parsed) - 1
        actions.append(rank_actions)
        columns.append(rank_columns)
    _check_bounds(actions, where)
    schedule = Schedule(actions, _infer_placement(actions, where), _num_microbatches(actions),
                        name=name)
    if validate:
        try:
            validate_schedule(schedule)
        except ScheduleError as exc:
            note = ""
            if comms or split:
                note = (f"\n(note: steps count the schedule's actions after dropping "
                        f"{len(comms)} communication cell(s) and splitting {split} OVERLAP_F_B "
                        f"cell(s), so they can differ from CSV columns)")
            raise ScheduleError(f"{where}: {exc}{note}") from None
        if comms:
            check_comms(comms, schedule, columns, where)
    return schedule


def _parse_cell(cell: str, format: str, where: str, rank: int, column: int):
    """``None`` (idle), a :class:`CommCell`, or a list of one or two compute actions."""
    text = cell.strip()
    if not text:
        return None
    overlap = _OVERLAP_RE.fullmatch(text)
    if overlap:
        parts = overlap.group(1).split(";")
        if len(parts) != 2:
            raise ScheduleError(f"{where}: cannot parse {quoted(cell)}: an OVERLAP_F_B cell holds "
                                f"exactly two actions, '(<forward>;<backward>)OVERLAP_F_B', "
                                f"got {len(parts)}")
        return [_compute(part, where, cell) for part in parts]
    if text.startswith("("):
        raise ScheduleError(f"{where}: cannot parse {quoted(cell)}: a cell starting with '(' "
                            f"must be '(<action>;<action>)OVERLAP_F_B'")
    comm = parse_comm_cell(text, rank, column, where)
    if comm is not None:
        if format == "compute_only":
            raise ScheduleError(
                f"{where}: {quoted(text)} is a communication action, but "
                f"format='compute_only' allows only F/B/I/W cells; read torch's compute_comms "
                f"dumps with format='auto' or "
                f"'compute_comms' (their comm cells are dropped and re-derived by lowering)")
        return comm
    return [_compute(text, where, cell)]


def _compute(text: str, where: str, cell: str):
    try:
        action = parse_action(text)
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    if action.kind not in COMPUTE_KINDS:  # pragma: no cover - comm cells are caught before
        raise ScheduleError(f"{where}: {quoted(cell)} is not a compute action")
    return action


def _check_bounds(actions, where: str) -> None:
    """Refuse indices the file itself rules out, before anything is sized by them.

    Stages are numbered 0..S-1 without gaps and every microbatch 0..M-1 is run forward, so a
    file of N actions has S <= N and M <= N: a larger index is a typo, and sizing a message or a
    table by it (``9999999F0``) would cost gigabytes.
    """
    count = sum(a is not None for row in actions for a in row)
    for rank, row in enumerate(actions):
        for action in row:
            if action is None:
                continue
            for what, index in (("stage", action.stage), ("microbatch", action.microbatch)):
                if index >= count:
                    raise ScheduleError(
                        f"{where}, row {rank}: {action} names {what} {index:,}, but the file "
                        f"holds {count} action(s); {what}s are numbered from 0 and each needs "
                        f"an action, so no {what} number can reach {count}")


def _infer_placement(actions, where: str) -> tuple[int, ...]:
    """The rank of each stage: the (only) row it appears in, as torch infers it."""
    rank_of: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            if action is None:
                continue
            other = rank_of.setdefault(action.stage, rank)
            if other != rank:
                raise ScheduleError(
                    f"{where}: stage {action.stage} appears in row {other} and in row {rank} "
                    f"(as {action}); each stage lives on exactly one rank, so all its actions "
                    f"must be in one row")
    if not rank_of:
        raise ScheduleError(f"{where} holds no actions; write one row per rank with cells like "
                            f"'0F0'")
    missing = sorted(set(range(max(rank_of) + 1)) - set(rank_of))
    if missing:
        raise ScheduleError(
            f"{where}: stage(s) {shorten(', '.join(map(str, missing)), 200)} appear in no row, "
            f"but stage "
            f"{max(rank_of)} does; stages must be numbered 0..{max(rank_of)} without gaps")
    return tuple(rank_of[s] for s in range(len(rank_of)))


def _num_microbatches(actions) -> int:
    return 1 + max(a.microbatch for row in actions for a in row if a is not None)


def format_csv(schedule: Schedule) -> str:
    """The compute-only CSV text (CRLF line endings, as torch's ``_dump_csv`` writes)."""
    if schedule.edges is not None and tuple(map(tuple, schedule.edges)) != \
            chain(schedule.num_stages):
        raise ScheduleError(f"schedule {schedule.name!r} has stage edges {list(schedule.edges)}; "
                            f"a CSV schedule (torch's) is the chain of its stages, so it cannot "
                            f"say them: keep the Schedule in Python")
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    for row in schedule.actions:
        writer.writerow("" if a is None else str(a) for a in row)
    return out.getvalue()


def write_csv(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write ``schedule`` as a compute-only CSV that torch's ``_load_csv`` reads."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        fh.write(format_csv(schedule))


def format_comms_csv(schedule: Schedule, dialect: str = "2.15") -> str:
    """The compute+comms CSV text of ``schedule`` (pp-core's lowering, with torch's FSDP and
    gradient-reduction cells; waits in dialect ``"2.15"``) that torch's
    ``_PipelineScheduleRuntime._load_csv(path, format="compute_comms")`` runs as written."""
    out = io.StringIO(newline="")
    csv.writer(out).writerows(comms_rows(schedule, lower(schedule), dialect))
    return out.getvalue()


def installed_torch_version() -> str | None:
    """The installed torch's version, read from its metadata (torch is not imported), or
    ``None`` without torch."""
    from importlib import metadata  # lazy: only the export of a compute_comms file asks

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
