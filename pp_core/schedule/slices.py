"""Sequence slices as units of any schedule: a generator's order over M*K units, made valid.

Why: with ``pipeline.pp_seq_chunks = K`` every microbatch is cut into K causal slices along the
sequence, and each slice is a unit of the schedule (Seq1F1B, NAACL 2025). A schedule plugin knows
nothing of slices; it orders ``M * K`` units as it orders microbatches. Two things make that
order run with slices (:mod:`pp_core.schedule.replay` has the rule: slice ``j``'s forward on a
stage reads slice ``j - 1``'s, slice ``j``'s backward reads slice ``j + 1``'s input gradient):

1. **Backward in reverse.** On each stage, the backward actions (``B`` or ``I``) the generator
   gave the K units of one microbatch take, in the row's order, slices ``K-1, ..., 0``; a ``W``
   follows the ``I`` it was paired with. Forwards keep their units (slice order ascending).
2. **Warm-up where it is needed.** A slice's backward cannot start before the last slice's
   forward has reached the last stage, so a 1F1B-shaped order stalls; the walk finds every
   stall and moves the forward that unblocks it (the first one in the chain of waits whose
   inputs are made) to where its rank stands. For 1F1B this is Seq1F1B exactly: each rank's
   warm-up grows by ``K - 1`` slices; orders that never stall (GPipe, looped BFS) are unchanged.

The result is validated like every schedule; nothing here knows a schedule by name.

    1f1b, num_ranks=2, num_microbatches=2, seq_chunks=2 (units u = microbatch * 2 + slice)
    rank 0: 0F0 0F1 0F2 0B1 0F3 0B0 0B3 0B2
    rank 1: 1F0 1F1 1B1 1F2 1B0 1F3 1B3 1B2
"""

from __future__ import annotations

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import F, W, Action, Schedule
from pp_core.schedule.replay import (B_CODE, F_CODE, FORWARD, I_CODE, KIND_CODE, W_CODE,
                                     Dependencies, Walk, decode, pack)

__all__ = ["cut_into_slices"]


def cut_into_slices(actions: list, stage_ranks: tuple[int, ...], num_units: int,
                    seq_chunks: int, name: str = "custom", edges=None) -> list[list[Action]]:
    """Each rank's actions of a schedule generated for ``num_units`` units, made to run with
    ``seq_chunks`` slices per microbatch (module docstring); idle cells are dropped."""
    K = seq_chunks
    if K == 1:
        return [list(row) for row in actions]
    rows = [[a for a in row if a is not None] for row in actions]
    relabelled = _shift_forwards(_reverse_backwards(rows, K), K - 1)
    schedule = Schedule(actions=relabelled, stage_ranks=tuple(stage_ranks),
                        num_microbatches=num_units, name=name, edges=edges, seq_chunks=K)
    M = num_units
    codes = [[pack(s * M + u, KIND_CODE[kind]) for s, kind, u in row] for row in relabelled]
    _Repair(schedule, codes, [peak + K - 1 for peak in _peaks(rows)]).run()
    return [[decode(c, M) for c in row] for row in codes]


def _shift_forwards(rows: list[list[Action]], shift: int) -> list[list[Action]]:
    """Each forward moved ``shift`` backwards (B or I) earlier in its row, W's staying with
    their backwards: a longer warm-up, the steady state's alternation kept (Seq1F1B's order)."""
    out = []
    for row in rows:
        others = [a for a in row if a.kind is not F]
        after_bi = [0]  # after_bi[k]: how many others precede the end of the k-th B/I
        for i, a in enumerate(others):
            if a.kind is not W:
                after_bi.append(i + 1)
        slots: list[list[Action]] = [[] for _ in range(len(others) + 1)]
        seen = bi = 0
        for a in row:
            if a.kind is not F:
                seen += 1
                bi += a.kind is not W
                continue
            back = min(shift, bi)
            slots[seen - (after_bi[bi] - after_bi[bi - back])].append(a)
        new = list(slots[0])
        for a, fs in zip(others, slots[1:]):
            new.append(a)
            new += fs
        out.append(new)
    return out


def _peaks(rows: list[list[Action]]) -> list[int]:
    """Per rank, the most units the generator's order holds at once (F started, B/W not)."""
    peaks = []
    for row in rows:
        live = peak = 0
        for _stage, kind, _unit in row:
            code = KIND_CODE[kind]
            live += 1 if code == F_CODE else -1 if code in (B_CODE, W_CODE) else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _reverse_backwards(rows: list[list[Action]], K: int) -> list[list[Action]]:
    """Step 1: per stage, a microbatch's backwards take slices K-1..0 in row order."""
    seen: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> backwards seen so far
    label: dict[tuple[int, int], int] = {}  # (stage, generated unit) -> unit its I took
    out = []
    for row in rows:
        new = []
        for stage, kind, unit in row:
            code = KIND_CODE.get(kind)
            if code in (B_CODE, I_CODE):
                mb = unit // K
                n = seen.get((stage, mb), 0)
                seen[stage, mb] = n + 1
                if n >= K:
                    raise ScheduleError(f"stage {stage} has more than {K} backwards of "
                                        f"microbatch {mb}'s slices; a schedule runs one per unit")
                label[stage, unit] = mb * K + K - 1 - n
                new.append(Action(stage, kind, label[stage, unit]))
            elif code == W_CODE:
                new.append(Action(stage, kind, label.get((stage, unit), unit)))
            else:
                new.append(Action(stage, kind, unit))
        out.append(new)
    return out


class _Repair:
    """Step 2: replay the rows in time (unit costs F=1, B=2, I=W=1 per slice); a rank whose next
    action waits runs its next forward instead when that one's inputs are there and it holds
    fewer units than its cap (the generator's own peak plus ``K - 1``: the slices the last
    stage must take in before it can start a backward). A stall no cap allows is broken by the
    forward that unblocks it."""

    _COST = (1.0, 2.0, 1.0, 1.0)

    def __init__(self, schedule: Schedule, codes: list[list[int]], caps: list[int]):
        self.schedule, self.codes, self.caps = schedule, codes, caps
        self.dependencies = Dependencies(schedule)
        self.split = {c >> 3 for row in codes for c in row if c & 7 == I_CODE}
        self.inputs = {}

    def _inputs(self, code: int) -> list[int]:
        found = self.inputs.get(code)
        if found is None:
            deps, M = self.dependencies, self.schedule.num_microbatches
            key, kind = code >> 3, code & 7
            place, K = deps.place(key), deps.seq_chunks
            found = []
            for p, made in deps.inputs(place, kind):
                other = key + (p // K - place // K) * M + p % K - place % K
                found.append(pack(other, F_CODE if made == FORWARD else
                                  I_CODE if other in self.split else B_CODE))
            self.inputs[code] = found
        return found

    def _ready(self, code: int, clock: float, ends: dict) -> float | None:
        t = clock
        for need in self._inputs(code):
            end = ends.get(need)
            if end is None:
                return None
            t = max(t, end)
        return t

    def run(self) -> None:
        rows = [list(row) for row in self.codes]
        done: list[list[int]] = [[] for _ in rows]
        clock = [0.0] * len(rows)
        live = [0] * len(rows)
        ends: dict[int, float] = {}
        while any(rows):
            best = None
            for r, row in enumerate(rows):
                if not row:
                    continue
                t = self._ready(row[0], clock[r], ends)
                choice = (t, 0) if t is not None else None
                if live[r] < self.caps[r]:
                    i = next((i for i, c in enumerate(row) if c & 7 == F_CODE), None)
                    tf = None if i is None else self._ready(row[i], clock[r], ends)
                    if tf is not None and (choice is None or tf < choice[0]):
                        choice = (tf, i)
                if choice is not None and (best is None or choice[0] < best[0]):
                    best = (choice[0], r, choice[1])
            if best is None:  # every rank waits: break the stall regardless of caps
                best = self._unstall(rows, ends)
            t, r, i = best
            code = rows[r].pop(i)
            kind = code & 7
            live[r] += 1 if kind == F_CODE else -1 if kind in (B_CODE, W_CODE) else 0
            clock[r] = ends[code] = t + self._COST[kind]
            done[r].append(code)
        self.codes[:] = done

    def _unstall(self, rows: list[list[int]], ends: dict) -> tuple[float, int, int]:
        """The forward at the end of a chain of waits whose inputs are made, as a choice."""
        where = {c: (r, i) for r, row in enumerate(rows) for i, c in enumerate(row)}
        r0 = next(r for r, row in enumerate(rows) if row)
        code, visited = rows[r0][0], set()
        while code not in visited:
            visited.add(code)
            need = next((c for c in self._inputs(code) if c not in ends), None)
            if need is None:
                r, i = where[code]
                if code & 7 == F_CODE:
                    return max([0.0] + [ends[c] for c in self._inputs(code)]), r, i
                code = rows[r][0]
            else:
                code = need
        raise ScheduleError(
            f"schedule {self.schedule.name!r} cannot run with seq_chunks="
            f"{self.schedule.seq_chunks}: its order waits in a cycle through "
            f"{decode(code, self.schedule.num_microbatches)} that moving a forward earlier "
            f"cannot break; use pp_seq_chunks: 1 or another schedule")
