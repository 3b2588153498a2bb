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
    replay = _Shared(dependencies, cost, latency, len(encoded))
    walk = Walk(encoded, dependencies)
    while True:
        for r in replay.due:  # offer them again: some may start now
            walk.wake(r)
        replay.due.clear()
        walk.run(replay.start)  # start what can start now; a zero-cost action ends there
        busy = [r for r in range(len(encoded)) if replay.running[r]]
        next_arrival = min(replay.due.values(), default=float("inf"))
        if not busy:
            if next_arrival == float("inf"):
                break  # everything ran (or a deadlock, which validation ruled out)
            replay.now = next_arrival
            continue
        rate = min(1.0, processors / len(busy))
        step = min(min(replay.left[r] for r in busy) / rate, next_arrival - replay.now)
        replay.now += step
        for r in busy:
            replay.left[r] -= step * rate
            if replay.left[r] <= _EPS * max(1.0, replay.now):
                replay.finish(r)
                walk.wake(r)
    return replay.starts, replay.ends


class _Shared:
    """The clock of :func:`replay_shared` and the walk's client: each action it is handed
    starts now, waits for its input to arrive, or, once finished, lets the walk go on."""

    def __init__(self, dependencies: Dependencies, cost, latency: float, num_ranks: int):
        self.inputs, self.cost, self.latency = dependencies.arrivals, cost, latency
        self.made = [0.0] * (2 * len(dependencies.stage_ranks) * dependencies.num_microbatches)
        self.now = 0.0
        self.left = [0.0] * num_ranks          # work left of the running action
        self.running = [False] * num_ranks
        self.finished = [False] * num_ranks     # its action ended: the walk may go on
        self.free_at = [0.0] * num_ranks        # end of the rank's previous action
        self.current = [(0, 0)] * num_ranks     # (key, kind) of the running action
        self.due: dict[int, float] = {}         # rank -> when its next action's input arrives
        self.starts: list[list[float]] = [[] for _ in range(num_ranks)]
        self.ends: list[list[float]] = [[] for _ in range(num_ranks)]

    def start(self, r: int, _code: int, key: int, stage: int, kind: int) -> bool:
        """The walk's visit: ``True`` holds rank ``r`` at this action (running, or waiting for
        its input to arrive)."""
        if self.finished[r]:
            self.finished[r] = False
            return False
        ready = self.free_at[r]
        for offset in self.inputs[kind][stage]:
            ready = max(ready, self.made[2 * key + offset] + self.latency)
        if ready > self.now + _EPS:
            self.due[r] = ready
            return True
        self.starts[r].append(self.now)
        self.current[r] = (key, kind)
        work = self.cost[stage][kind]
        if work <= 0.0:
            self._ended(r, key, kind)
            return False
        self.left[r], self.running[r] = work, True
        return True

    def finish(self, r: int) -> None:
        """Rank ``r``'s running action ends now."""
        self._ended(r, *self.current[r])
        self.running[r] = False
        self.finished[r] = True

    def _ended(self, r: int, key: int, kind: int) -> None:
        made = MAKES[kind]
        if made is not None:
            self.made[2 * key + made] = self.now
        self.ends[r].append(self.now)
        self.free_at[r] = self.now
