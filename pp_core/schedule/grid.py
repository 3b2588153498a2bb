"""The rank x step grid that schedule errors print, with the bad or blocked cells marked.

A window of ``schedule.actions`` around the marked ``(rank, step)`` cells, steps counted as in the
CSV (idle cells included), so a message can show where in the schedule the problem sits::

    grid (steps 0..5 shown; blocked/bad actions in [brackets]):
    step     0     1     2     3     4     5
    rank 0  0F0   0F1  [0B1]  0B0    .     .
"""

from __future__ import annotations

from pp_core.schedule.ir import Schedule

__all__ = ["format_grid"]


def format_grid(schedule: Schedule, marks: set[tuple[int, int]], context: int = 4,
                max_columns: int = 32, max_rows: int = 24) -> str:
    """The rank x step grid around the marked ``(rank, step)`` cells, each shown as ``[2F0]``."""
    actions = schedule.actions
    steps = sorted(step for _, step in marks) or [0]
    lo = max(0, steps[0] - context)
    hi = min(max(len(row) for row in actions), steps[-1] + context + 1)
    if hi - lo > max_columns:
        hi = lo + max_columns
    ranks = sorted({r for r, _ in marks})
    rows = list(range(len(actions)))
    if len(rows) > max_rows:
        keep = set()
        for r in ranks:
            keep.update(range(max(0, r - 2), min(len(rows), r + 3)))
        rows = sorted(keep)[:max_rows]
    cells = {}
    width = 3
    for r in rows:
        for step in range(lo, hi):
            a = actions[r][step] if step < len(actions[r]) else None
            text = "." if a is None else str(a)
            if (r, step) in marks:
                text = f"[{text}]"
            cells[r, step] = text
            width = max(width, len(text))
    label = max(len(f"rank {rows[-1]}"), len("step"))
    lines = ["step".ljust(label) + " " + " ".join(str(s).center(width) for s in range(lo, hi))]
    previous = None
    for r in rows:
        if previous is not None and r != previous + 1:
            lines.append("...")
        previous = r
        lines.append(f"rank {r}".ljust(label) + " " +
                     " ".join(cells[r, s].center(width) for s in range(lo, hi)))
    note = f" (steps {lo}..{hi - 1} shown; blocked/bad actions in [brackets])"
    return "grid" + note + ":\n" + "\n".join(line.rstrip() for line in lines)
