"""Replay a schedule on ranks that share fewer processors than there are ranks (pure).

Why: one-thread CPU ranks on a node with fewer cores than ranks (4 pipeline ranks on a 2-core
machine, or pp x dp ranks on a small node) do not each run at full speed: the operating system
shares the cores among the ranks that have work. A schedule whose ranks are mostly busy at once
is then bound by the total work over the cores, not by its bubble, and the plain replay
(:func:`pp_core.schedule.simulate._replay`, one processor per rank) predicts it up to ``ranks /
processors`` times too fast.

The model is processor sharing, the fluid limit of a time-sliced scheduler: while ``n`` ranks
have an action running, each progresses at ``min(1, processors / n)`` of its full speed; a rank
that waits for a hand-off takes no processor. Dependencies and the latency on cross-rank
hand-offs are those of the plain replay; with ``processors >= ranks`` the two give the same
times. Events (an action ends, a hand-off arrives) are processed in time order; between them the
walk of :mod:`pp_core.schedule.replay` starts what can start, holding a rank at an action while
it runs or while its input is on its way. Each event costs a pass over the ranks, so a replay is
``O(actions x ranks)``.
"""

from __future__ import annotations

from pp_core.schedule.ir import Schedule
from pp_core.schedule.replay import MAKES, Dependencies, Walk

__all__ = ["replay_shared"]

_EPS = 1e-12


def replay_shared(schedule: Schedule, encoded: list[list[int]], cost, latency: float,
                  processors: float) -> tuple[list[list[float]], list[list[float]]]:
    """``(starts, ends)`` of every encoded action on ranks sharing ``processors``. The schedule
    must be known to be deadlock-free (it was validated)."""
    dependencies = Dependencies(schedule)
    arrivals, num_ranks = dependencies.arrivals, len(encoded)
    made = [0.0] * (2 * schedule.num_stages * schedule.num_microbatches)  # per unit and made
    left = [0.0] * num_ranks  # work left of the running action
    running = [False] * num_ranks
    finished = [False] * num_ranks  # its action ended: the walk may go on
    free_at = [0.0] * num_ranks  # end of the rank's previous action
    current = [(0, 0)] * num_ranks  # (key, kind) of the running action
    due: dict[int, float] = {}  # rank -> when its next action's input arrives
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    ends: list[list[float]] = [[] for _ in range(num_ranks)]
    now = 0.0

    def ended(r: int, key: int, kind: int) -> None:
        if MAKES[kind] is not None:
            made[2 * key + MAKES[kind]] = now
        ends[r].append(now)
        free_at[r] = now

    def start(r: int, _code: int, key: int, stage: int, kind: int) -> bool:
        """The walk's visit: ``True`` holds rank ``r`` at this action (running, or waiting for
        its input to arrive); once it has finished, the walk goes on."""
        if finished[r]:
            finished[r] = False
            return False
        ready = free_at[r]
        for offset in arrivals[kind][dependencies.place(key)]:
            ready = max(ready, made[2 * key + offset] + latency)
        if ready > now + _EPS:
            due[r] = ready
            return True
        starts[r].append(now)
        current[r] = (key, kind)
        work = cost[stage][kind]
        if work <= 0.0:  # a zero-cost action ends where it starts
            ended(r, key, kind)
            return False
        left[r], running[r] = work, True
        return True

    walk = Walk(encoded, dependencies)
    while True:
        for r in due:  # offer them again: some may start now
            walk.wake(r)
        due.clear()
        walk.run(start)  # start what can start now
        busy = [r for r in range(num_ranks) if running[r]]
        next_arrival = min(due.values(), default=float("inf"))
        if not busy:
            if next_arrival == float("inf"):
                break  # everything ran (or a deadlock, which validation ruled out)
            now = next_arrival
            continue
        rate = min(1.0, processors / len(busy))
        step = min(min(left[r] for r in busy) / rate, next_arrival - now)
        now += step
        for r in busy:
            left[r] -= step * rate
            if left[r] <= _EPS * max(1.0, now):
                ended(r, *current[r])
                running[r], finished[r] = False, True
                walk.wake(r)
    return starts, ends
