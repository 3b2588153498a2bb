"""Deadlock freedom of a schedule (validation's rule 4) and the message when it fails.

A list-scheduling run over the encoded rows of :func:`~pp_core.schedule.validate.encode_validated`
(``key * 4 + kind``): each rank executes its next action as soon as its inputs exist, and each
finished F/B/I wakes only the one rank that consumes it, so the run is linear in the actions.
When ranks stay blocked, the error follows the chain of waits to a cycle and prints the rank x
step grid with it marked.
"""

from __future__ import annotations

from pp_core.errors import ScheduleError
from pp_core.schedule.grid import format_grid
from pp_core.schedule.ir import B, F, I, W, Action, Schedule

__all__ = ["KIND_CODE", "list_schedule", "raise_deadlock"]

KIND_CODE = {F: 0, B: 1, I: 2, W: 3}
"""The kind's code in an encoded action, ``key * 4 + code`` (validation's pass 1 writes it)."""


def raise_deadlock(schedule: Schedule, encoded: list[list[int]], ptr: list[int]) -> None:
    """Raise the deadlock error for a list-scheduling run stuck at per-rank positions ``ptr``."""
    _deadlock(schedule, encoded, ptr, schedule.num_microbatches)


def list_schedule(schedule: Schedule, encoded: list[list[int]], num_stages: int, M: int) -> None:
    """List-schedule the ranks; each finished F/B/I wakes the one rank that consumes it."""
    stage_ranks = schedule.stage_ranks
    num_ranks = len(encoded)
    fdone = bytearray(num_stages * M)
    bdone = bytearray(num_stages * M)
    last_key = (num_stages - 1) * M  # keys >= this are on the last stage
    ptr = [0] * num_ranks
    blocked = [False] * num_ranks
    queue = list(range(num_ranks - 1, -1, -1))
    while queue:
        r = queue.pop()
        row = encoded[r]
        p = ptr[r]
        n = len(row)
        while p < n:
            c = row[p]
            kc = c & 3
            key = c >> 2
            if kc == 0:
                if key >= M and not fdone[key - M]:
                    break
                fdone[key] = 1
                if key < last_key:
                    t = stage_ranks[key // M + 1]
                    if blocked[t]:
                        blocked[t] = False
                        queue.append(t)
            elif kc != 3:
                if key < last_key and not bdone[key + M]:
                    break
                bdone[key] = 1
                if key >= M:
                    t = stage_ranks[key // M - 1]
                    if blocked[t]:
                        blocked[t] = False
                        queue.append(t)
            p += 1
        ptr[r] = p
        if p < n:
            blocked[r] = True
    if any(blocked):
        _deadlock(schedule, encoded, ptr, M)


def _raw_step(schedule: Schedule, r: int, index: int) -> int:
    """The position in ``schedule.actions[r]`` (idle cells counted) of the index-th action."""
    seen = -1
    for step, a in enumerate(schedule.actions[r]):
        if a is not None:
            seen += 1
            if seen == index:
                return step
    return len(schedule.actions[r])


def _decode(code: int, M: int) -> Action:
    s, mb = divmod(code >> 2, M)
    return Action(s, (F, B, I, W)[code & 3], mb)


def _deadlock(schedule: Schedule, encoded: list[list[int]], ptr: list[int], M: int) -> None:
    """Explain the wait cycle, starting at the first rank of the cycle the first stuck rank hits."""
    r = next(r for r in range(len(encoded)) if ptr[r] < len(encoded[r]))
    _text, _marks, r = _wait_chain(schedule, encoded, ptr, M, r)  # find a rank on the cycle
    text, marks, _ = _wait_chain(schedule, encoded, ptr, M, r)
    head = _decode(encoded[r][ptr[r]], M)
    raise ScheduleError(
        f"schedule {schedule.name!r} deadlocks at rank {r} step {_raw_step(schedule, r, ptr[r])} "
        f"({head}): no rank can make progress\n  {text}.\nReorder the actions so every F(s,k) "
        f"comes after F(s-1,k) and every I/B(s,k) after I/B(s+1,k) can have finished.\n"
        f"{format_grid(schedule, marks)}")


def _wait_chain(schedule, encoded, ptr, M, r):
    """Follow "waits for" from rank ``r``'s next action until a rank repeats; return the text."""
    head = _decode(encoded[r][ptr[r]], M)
    step = _raw_step(schedule, r, ptr[r])
    marks = {(r, step)}
    visited = {r: f"rank {r} step {step}"}
    text = f"rank {r} step {step}: {head}"
    while True:
        dep = _dependency(schedule, encoded, head, M)
        dr = schedule.stage_ranks[dep.stage]
        dindex = _index_of(encoded[dr], _encode_one(dep, M))
        text += f" waits for {dep} at rank {dr} step {_raw_step(schedule, dr, dindex)}"
        head = _decode(encoded[dr][ptr[dr]], M)
        hstep = _raw_step(schedule, dr, ptr[dr])
        marks.add((dr, hstep))
        if dindex != ptr[dr]:
            text += f",\n  which comes after {head} at rank {dr} step {hstep}"
        if dr in visited:
            text += f",\n  which closes the cycle (back at {visited[dr]})"
            return text, marks, dr
        visited[dr] = f"rank {dr} step {hstep}"
        text += ",\n  which"


def _dependency(schedule: Schedule, encoded: list[list[int]], action: Action, M: int) -> Action:
    s, kind, mb = action
    if kind == F:
        return Action(s - 1, F, mb)
    nxt = s + 1
    row = encoded[schedule.stage_ranks[nxt]]
    has_i = _index_of(row, _encode_one(Action(nxt, I, mb), M)) >= 0
    return Action(nxt, I if has_i else B, mb)


def _encode_one(action: Action, M: int) -> int:
    return (action.stage * M + action.microbatch) * 4 + KIND_CODE[action.kind]


def _index_of(row: list[int], code: int) -> int:
    try:
        return row.index(code)
    except ValueError:
        return -1
