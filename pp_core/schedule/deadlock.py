"""The message when a schedule deadlocks (validation's rule 4): the chain of waits, and the grid.

The walk itself is :class:`~pp_core.schedule.replay.Walk`; when ranks stay blocked, this
follows what each stuck rank's next action waits for (the rule of
:meth:`~pp_core.schedule.replay.Dependencies.inputs`) to a cycle and prints the rank x step
grid with it marked.
"""

from __future__ import annotations

from pp_core.errors import ScheduleError
from pp_core.schedule.grid import format_grid
from pp_core.schedule.ir import B, F, I, Action, Schedule
from pp_core.schedule.replay import FORWARD, KIND_CODE, Dependencies, Walk, decode, encode

__all__ = ["walk_or_raise"]


def walk_or_raise(schedule: Schedule, encoded: list[list[int]], visit=None,
                  dependencies: Dependencies | None = None) -> Walk:
    """Run the walk over ``encoded`` (``visit`` sees each action); raise the deadlock error if
    ranks stay blocked."""
    walk = Walk(encoded, dependencies or Dependencies(schedule))
    walk.run(visit)
    if walk.stuck():
        _raise_deadlock(schedule, encoded, walk.ptr)
    return walk


def _raise_deadlock(schedule: Schedule, encoded: list[list[int]], ptr: list[int]) -> None:
    """Raise the deadlock error for a walk stuck at per-rank positions ``ptr``."""
    M = schedule.num_microbatches
    dependencies = Dependencies(schedule)
    r = next(r for r in range(len(encoded)) if ptr[r] < len(encoded[r]))
    chain = _WaitChain(schedule, encoded, ptr, dependencies)
    _text, _marks, r = chain.follow(r)  # find a rank on the cycle
    text, marks, _ = chain.follow(r)
    head = decode(encoded[r][ptr[r]], M)
    raise ScheduleError(
        f"schedule {schedule.name!r} deadlocks at rank {r} step {_raw_step(schedule, r, ptr[r])} "
        f"({head}): no rank can make progress\n  {text}.\nReorder the actions so every F(s,k) "
        f"comes after F(s-1,k) and every I/B(s,k) after I/B(s+1,k) can have finished"
        f"{_SLICES if schedule.seq_chunks > 1 else ''}.\n"
        f"{format_grid(schedule, marks)}")


_SLICES = ("; with sequence slices also every F of a slice after the previous slice's F on its "
           "stage, and every I/B of a slice after the next slice's I/B there")


def _raw_step(schedule: Schedule, r: int, index: int) -> int:
    """The position in ``schedule.actions[r]`` (idle cells counted) of the index-th action."""
    seen = -1
    for step, a in enumerate(schedule.actions[r]):
        if a is not None:
            seen += 1
            if seen == index:
                return step
    return len(schedule.actions[r])


class _WaitChain:
    """Who waits for whom in a stuck walk."""

    def __init__(self, schedule, encoded, ptr, dependencies):
        self.schedule, self.encoded, self.ptr = schedule, encoded, ptr
        self.dependencies = dependencies
        self.M = schedule.num_microbatches

    def follow(self, r: int):
        """Follow "waits for" from rank ``r``'s next action until a rank repeats; return the
        text, the marked cells and the rank that closed the cycle."""
        schedule, encoded, ptr, M = self.schedule, self.encoded, self.ptr, self.M
        head = decode(encoded[r][ptr[r]], M)
        step = _raw_step(schedule, r, ptr[r])
        marks = {(r, step)}
        visited = {r: f"rank {r} step {step}"}
        text = f"rank {r} step {step}: {head}"
        while True:
            dep = self.missing_input(head)
            dr = schedule.stage_ranks[dep.stage]
            dindex = _index_of(encoded[dr], encode(dep, M))
            text += f" waits for {dep} at rank {dr} step {_raw_step(schedule, dr, dindex)}"
            head = decode(encoded[dr][ptr[dr]], M)
            hstep = _raw_step(schedule, dr, ptr[dr])
            marks.add((dr, hstep))
            if dindex != ptr[dr]:
                text += f",\n  which comes after {head} at rank {dr} step {hstep}"
            if dr in visited:
                text += f",\n  which closes the cycle (back at {visited[dr]})"
                return text, marks, dr
            visited[dr] = f"rank {dr} step {hstep}"
            text += ",\n  which"

    def missing_input(self, action: Action) -> Action:
        """The first input of ``action`` not yet made, as the action that makes it (for an
        input gradient: the stage's ``I`` if its row has one, else its ``B``)."""
        stage, kind, mb = action
        makers = []
        K = self.dependencies.seq_chunks
        place = stage * K + mb % K
        for p, made in self.dependencies.inputs(place, KIND_CODE[kind]):
            s, unit = p // K, mb - mb % K + p % K
            row = self.encoded[self.schedule.stage_ranks[s]]
            if made == FORWARD:
                maker = Action(s, F, unit)
            else:
                split = _index_of(row, encode(Action(s, I, unit), self.M)) >= 0
                maker = Action(s, I if split else B, unit)
            if not 0 <= _index_of(row, encode(maker, self.M)) < self.ptr[
                    self.schedule.stage_ranks[s]]:
                return maker
            makers.append(maker)
        return makers[0]


def _index_of(row: list[int], code: int) -> int:
    try:
        return row.index(code)
    except ValueError:
        return -1
