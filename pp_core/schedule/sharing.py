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
times. Events (an action ends, a hand-off arrives) are processed in time order: each costs a
pass over the ranks, so a replay is ``O(actions x ranks)``.
"""

from __future__ import annotations

from pp_core.schedule.ir import Schedule

__all__ = ["replay_shared"]

_EPS = 1e-12


def replay_shared(schedule: Schedule, encoded: list[list[int]], cost, latency: float,
                  processors: float) -> tuple[list[list[float]], list[list[float]]]:
    """``(starts, ends)`` of every encoded action (``(stage * M + mb) << 2 | kind``, kinds
    F=0, B=1, I=2, W=3) on ranks sharing ``processors``. The schedule must be known to be
    deadlock-free (it was validated)."""
    stage_ranks = schedule.stage_ranks
    M = schedule.num_microbatches
    num_ranks = len(encoded)
    size = schedule.num_stages * M
    last_key = size - M
    fend = [-1.0] * size   # end time of F(key); -1 = not yet
    bend = [-1.0] * size   # end time of I/B(key)
    ptr = [0] * num_ranks
    left = [0.0] * num_ranks            # work left of the running action
    running = [False] * num_ranks
    free_at = [0.0] * num_ranks          # end of the rank's previous action
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    ends: list[list[float]] = [[] for _ in range(num_ranks)]
    now = 0.0

    def ready_time(r: int) -> float:
        """When the action at ``ptr[r]`` may start; -1 while its input is not produced."""
        c = encoded[r][ptr[r]]
        kc, key = c & 3, c >> 2
        s = key // M
        ready = free_at[r]
        if kc == 0 and key >= M:
            done = fend[key - M]
            if done < 0:
                return -1.0
            ready = max(ready, done + (latency if stage_ranks[s - 1] != r else 0.0))
        elif kc in (1, 2) and key < last_key:
            done = bend[key + M]
            if done < 0:
                return -1.0
            ready = max(ready, done + (latency if stage_ranks[s + 1] != r else 0.0))
        return ready

    def finish(r: int, at: float) -> None:
        c = encoded[r][ptr[r]]
        kc, key = c & 3, c >> 2
        if kc == 0:
            fend[key] = at
        elif kc != 3:
            bend[key] = at
        ends[r].append(at)
        free_at[r] = at
        running[r] = False
        ptr[r] += 1

    while True:
        # start what can start now; a zero-cost action ends where it starts
        progressed = True
        next_arrival = float("inf")
        while progressed:
            progressed = False
            next_arrival = float("inf")
            for r in range(num_ranks):
                while not running[r] and ptr[r] < len(encoded[r]):
                    ready = ready_time(r)
                    if ready < 0:
                        break
                    if ready > now + _EPS:
                        next_arrival = min(next_arrival, ready)
                        break
                    c = encoded[r][ptr[r]]
                    starts[r].append(now)
                    work = cost[(c >> 2) // M][c & 3]
                    if work <= 0.0:
                        finish(r, now)
                        progressed = True
                        continue
                    left[r], running[r] = work, True
        busy = [r for r in range(num_ranks) if running[r]]
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
                finish(r, now)
    return starts, ends
