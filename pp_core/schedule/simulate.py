"""Discrete-event simulation of a compute-only schedule: makespan, bubble, memory.

Each rank executes its actions in order; an action starts at ``max(rank free, end of its input +
comm latency)`` with the dependency rules of validation (``F(s,k)`` needs ``F(s-1,k)``,
``I/B(s,k)`` needs ``I/B(s+1,k)``), the model the published bubble formulas assume, so with unit
costs the results match them (docs/schedules.md, "Bubble ratio"). The run is linear in the number
of actions (same per-rank pointers and wake-ups as validation).

Figures:

* **bubble** (makespan bubble): ``max over ranks of (makespan - busy)``; ``bubble_ratio`` =
  bubble / makespan.
* **span bubble**: ``max over ranks of (last end - first start - busy)`` (the ZB papers' figure;
  it ignores the staggered start that only overlaps a previous iteration).
* **peak in-flight activations** per rank: max number of ``(stage, microbatch)`` pairs whose F
  has started and whose B (or W, when the backward is split) has not finished; in bytes too when
  ``activation_bytes`` (per stage) is given, plus, with ``input_grad_held_bytes``, what a split
  backward's I adds until its W (the gradients W restarts from).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import B, F, I, W, Action, Schedule
from pp_core.schedule.build import gc_paused
from pp_core.schedule.sharing import replay_shared
from pp_core.schedule.validate import encode_validated, raise_deadlock

__all__ = ["Costs", "SimResult", "simulate", "peak_activation_bytes"]

_KINDS = (F, B, I, W)


@dataclass(frozen=True)
class Costs:
    """Time per action. ``per_stage`` overrides some of them for some stages:
    ``Costs(per_stage={3: {"F": 1.5, "B": 3}})`` (an embedding or loss stage is often heavier).
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - torch's letter for the input-gradient pass
    W: float = 1.0
    per_stage: Mapping[int, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self):
        for name in "FBIW":
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ScheduleError(f"cost {name} must be a number >= 0, got {value!r}")
        for stage, overrides in self.per_stage.items():
            for name, value in overrides.items():
                if name not in ("F", "B", "I", "W"):
                    raise ScheduleError(f"per-stage cost for stage {stage} names kind {name!r}; "
                                        f"use F, B, I or W")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ScheduleError(f"per-stage cost {name} of stage {stage} must be a "
                                        f"number >= 0, got {value!r}")

    def table(self, num_stages: int) -> list[tuple[float, float, float, float]]:
        """``table[stage][kind code]`` with kind codes F=0, B=1, I=2, W=3."""
        base = (float(self.F), float(self.B), float(self.I), float(self.W))
        rows = [base] * num_stages
        for stage, overrides in self.per_stage.items():
            if not 0 <= stage < num_stages:
                raise ScheduleError(f"per-stage cost names stage {stage}, but the schedule has "
                                    f"{num_stages} stages (0..{num_stages - 1})")
            rows[stage] = tuple(float(overrides.get(k, base[i])) for i, k in enumerate("FBIW"))
        return rows

    def to_dict(self) -> dict:
        out = {"F": _num(self.F), "B": _num(self.B), "I": _num(self.I), "W": _num(self.W)}
        if self.per_stage:
            out["per_stage"] = {str(s): {k: _num(x) for k, x in v.items()}
                                for s, v in self.per_stage.items()}
        return out


@dataclass
class SimResult:
    """What :func:`simulate` measured. ``timeline[r]`` = ``(action, start, end)`` in rank order."""

    schedule: Schedule
    costs: Costs
    comm_latency: float
    makespan: float
    busy: list[float]
    first_start: list[float]
    last_end: list[float]
    peak_activations: list[int]
    peak_activation_bytes: list[float] | None = None
    processors: float | None = None
    """The processors the ranks shared, when fewer than the ranks; ``None``: one each."""
    starts: list[list[float]] = field(default_factory=list, repr=False)
    """Start time of each rank's compute actions, in order (idle cells skipped)."""
    _encoded: list[list[int]] = field(default_factory=list, repr=False)
    _cost: list = field(default_factory=list, repr=False)
    _ends: list[list[float]] | None = field(default=None, repr=False)  # set when shared

    @functools.cached_property
    def timeline(self) -> list[list[tuple[Action, float, float]]]:
        """Per rank, ``(action, start, end)`` for every compute action (built on first use)."""
        M = self.schedule.num_microbatches
        out = []
        for r, (row, starts) in enumerate(zip(self._encoded, self.starts)):
            events = []
            for i, (c, t0) in enumerate(zip(row, starts)):
                s, mb = divmod(c >> 2, M)
                kc = c & 3
                t1 = self._ends[r][i] if self._ends is not None else t0 + self._cost[s][kc]
                events.append((Action(s, _KINDS[kc], mb), t0, t1))
            out.append(events)
        return out

    @property
    def idle(self) -> list[float]:
        """Per rank: makespan - busy."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Makespan bubble: the most idle time of any rank."""
        return max(self.idle)

    @property
    def bubble_ratio(self) -> float:
        return self.bubble / self.makespan if self.makespan > 0 else 0.0

    @property
    def span_bubble(self) -> float:
        """Max over ranks of (last end - first start - busy): idle time between a rank's first
        and last action."""
        return max(e - s - b for s, e, b in zip(self.first_start, self.last_end, self.busy))

    def to_dict(self, timeline: bool = False) -> dict:
        """JSON-able figures (and the whole timeline with ``timeline=True``)."""
        s = self.schedule
        out = {
            "schedule": s.name,
            "pp": s.num_ranks,
            "num_stages": s.num_stages,
            "stages_per_rank": [len(s.stages_of(r)) for r in range(s.num_ranks)],
            "microbatches": s.num_microbatches,
            "costs": self.costs.to_dict(),
            "comm_latency": _num(self.comm_latency),
            "processors": None if self.processors is None else _num(self.processors),
            "makespan": _num(self.makespan),
            "bubble": _num(self.bubble),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "span_bubble": _num(self.span_bubble),
            "busy": [_num(b) for b in self.busy],
            "idle": [_num(i) for i in self.idle],
            "peak_activations": list(self.peak_activations),
        }
        if self.peak_activation_bytes is not None:
            out["peak_activation_bytes"] = [_num(b) for b in self.peak_activation_bytes]
        if timeline:
            out["timeline"] = [[[str(a), _num(t0), _num(t1)] for a, t0, t1 in row]
                               for row in self.timeline]
        return out


def _num(x: float):
    x = round(float(x), 9)
    return int(x) if x.is_integer() else x


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    comm_latency: float = 0.0,
    activation_bytes: float | Sequence[float] | None = None,
    processors: float | None = None,
    input_grad_held_bytes: float | Sequence[float] | None = None,
) -> SimResult:
    """Validate ``schedule`` and replay it with ``costs``; see the module docstring.

    :param comm_latency: added to every dependency between different ranks (a stage hand-off on
        the same rank, as in V placement, is free).
    :param activation_bytes: one stage-microbatch's saved activations, per stage (a sequence)
        or for every stage (a number); adds ``peak_activation_bytes``.
    :param processors: how many processors the ranks share, when fewer than the ranks (CPU
        ranks on a small node): busy ranks then run at ``processors / busy`` of full speed
        (:mod:`pp_core.schedule.sharing`). ``None``: one processor per rank.
    :param input_grad_held_bytes: per stage (or one number), bytes an ``I`` adds and its ``W``
        frees, on top of ``activation_bytes`` (which is 0 when not given); ``B`` is unaffected.
        They count from the state after the ``I`` on (the peak is taken after every ``F`` and
        before every other action), not while it runs: there they are among its temporaries.
    """
    costs = Costs() if costs is None else costs
    if isinstance(comm_latency, bool) or not isinstance(comm_latency, (int, float)) \
            or comm_latency < 0:
        raise ScheduleError(f"comm_latency must be a number >= 0, got {comm_latency!r}")
    if processors is not None and (isinstance(processors, bool) or not isinstance(
            processors, (int, float)) or not processors > 0):
        raise ScheduleError(f"processors must be a number > 0 (or None), got {processors!r}")
    held = _stage_bytes(input_grad_held_bytes, schedule.num_stages, "input_grad_held_bytes")
    stage_bytes = _stage_bytes(activation_bytes if held is None or activation_bytes is not None
                               else 0.0, schedule.num_stages)
    cost = costs.table(schedule.num_stages)
    ends = None
    with gc_paused():
        encoded = encode_validated(schedule, check_deadlock=False)
        if processors is not None and processors < schedule.num_ranks:
            starts, ends = replay_shared(schedule, encoded, cost, float(comm_latency),
                                         float(processors))
        else:
            starts = _replay(schedule, encoded, cost, float(comm_latency))
    M = schedule.num_microbatches
    busy, first, last, peaks, peak_bytes = [], [], [], [], []
    uniform = not costs.per_stage
    for r, (row, st) in enumerate(zip(encoded, starts)):
        live = peak = 0
        counts = [0, 0, 0, 0]
        total = 0.0
        for c in row:
            kc = c & 3
            if uniform:
                counts[kc] += 1
            else:
                total += cost[(c >> 2) // M][kc]
            if kc == 0:
                live += 1
                if live > peak:
                    peak = live
            elif kc != 2:
                live -= 1
        if uniform:
            total = sum(n * d for n, d in zip(counts, cost[0]))
        busy.append(total)
        first.append(st[0] if st else 0.0)
        if not st:
            last.append(0.0)
        else:  # shared processors stretch actions: their ends are the replay's own
            last.append(ends[r][-1] if ends is not None
                        else st[-1] + cost[(row[-1] >> 2) // M][row[-1] & 3])
        peaks.append(peak)
        if stage_bytes is not None:
            peak_bytes.append(_rank_peak_bytes(row, M, stage_bytes, held))
    return SimResult(
        schedule=schedule, costs=costs, comm_latency=float(comm_latency),
        makespan=max(last), busy=busy, first_start=first, last_end=last,
        peak_activations=peaks,
        peak_activation_bytes=peak_bytes if stage_bytes is not None else None,
        processors=float(processors) if ends is not None else None, starts=starts,
        _encoded=encoded, _cost=cost, _ends=ends,
    )


def peak_activation_bytes(schedule: Schedule, activation_bytes: Sequence[float],
                          input_grad_held_bytes: Sequence[float] | None = None,
                          encoded: list[list[int]] | None = None,
                          transient_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank, the ``peak_activation_bytes`` of :func:`simulate` without the timing replay
    (the bytes follow each rank's own order, not the clock): what a planner that tries many
    byte figures on one schedule calls. ``encoded``: the schedule's
    :func:`~pp_core.schedule.validate.encode_validated` rows, to skip encoding again.
    ``transient_bytes`` (per stage): the temporaries a stage's actions hold while they run (a
    checkpointed block's recomputed activations), counted on top of what is live when each of
    its ``B``, ``I`` or ``W`` starts and each ``F`` ends - not on top of the rank's peak, which
    may come where they are not."""
    held = _stage_bytes(input_grad_held_bytes, schedule.num_stages, "input_grad_held_bytes")
    stage_bytes = _stage_bytes(activation_bytes, schedule.num_stages)
    transient = _stage_bytes(transient_bytes, schedule.num_stages, "transient_bytes")
    if encoded is None:
        encoded = encode_validated(schedule, check_deadlock=False)
    return [_rank_peak_bytes(row, schedule.num_microbatches, stage_bytes, held, transient)
            for row in encoded]


def _rank_peak_bytes(row, M: int, stage_bytes: list[float], held: list[float] | None,
                     transient: list[float] | None = None) -> float:
    """The most bytes one rank's saved activations (and split-backward holdings, and with
    ``transient`` each backward's temporaries while it runs) reach."""
    live_b = peak_b = 0.0
    for c in row:
        kc = c & 3
        stage = (c >> 2) // M
        if transient is not None and kc and live_b + transient[stage] > peak_b:
            peak_b = live_b + transient[stage]
        if kc == 0:
            live_b += stage_bytes[stage]
            if live_b > peak_b:
                peak_b = live_b
            if transient is not None and live_b + transient[stage] > peak_b:
                peak_b = live_b + transient[stage]  # its forward's, on what it saved
        elif kc != 2:
            if held is not None:  # what the I before it left, not seen at an F yet
                if live_b > peak_b:
                    peak_b = live_b
                if kc == 3:
                    live_b -= held[stage]
            live_b -= stage_bytes[stage]
        elif held is not None:  # the state before it: while it runs its own additions
            if live_b > peak_b:  # are among its temporaries (the memory model's transient),
                peak_b = live_b  # after it they are counted here
            live_b += held[stage]
    return peak_b


def _stage_bytes(activation_bytes, num_stages: int,
                 name: str = "activation_bytes") -> list[float] | None:
    if activation_bytes is None:
        return None
    if isinstance(activation_bytes, (int, float)) and not isinstance(activation_bytes, bool):
        return [float(activation_bytes)] * num_stages
    values = list(activation_bytes)
    if len(values) != num_stages:
        raise ScheduleError(f"{name} has {len(values)} entries; give one per stage "
                            f"({num_stages}) or a single number for every stage")
    return [float(v) for v in values]


def _replay(schedule: Schedule, encoded: list[list[int]], cost,
            latency: float) -> list[list[float]]:
    """Start time of every encoded action (the schedule is known to be deadlock-free)."""
    stage_ranks = schedule.stage_ranks
    num_ranks = len(encoded)
    M = schedule.num_microbatches
    size = schedule.num_stages * M
    last_key = size - M
    fend = [-1.0] * size  # end time of F(key), -1 = not yet
    bend = [-1.0] * size  # end time of I/B(key)
    clock = [0.0] * num_ranks
    ptr = [0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    blocked = [False] * num_ranks
    queue = list(range(num_ranks - 1, -1, -1))
    while queue:
        r = queue.pop()
        row = encoded[r]
        out = starts[r]
        p, n, t = ptr[r], len(row), clock[r]
        while p < n:
            c = row[p]
            kc = c & 3
            key = c >> 2
            s = key // M
            if kc == 0:
                if key >= M:
                    ready = fend[key - M]
                    if ready < 0:
                        break
                    if stage_ranks[s - 1] != r:
                        ready += latency
                    if ready > t:
                        t = ready
                out.append(t)
                t += cost[s][0]
                fend[key] = t
                if key < last_key:
                    target = stage_ranks[s + 1]
                    if blocked[target]:
                        blocked[target] = False
                        queue.append(target)
            elif kc != 3:
                if key < last_key:
                    ready = bend[key + M]
                    if ready < 0:
                        break
                    if stage_ranks[s + 1] != r:
                        ready += latency
                    if ready > t:
                        t = ready
                out.append(t)
                t += cost[s][kc]
                bend[key] = t
                if key >= M:
                    target = stage_ranks[s - 1]
                    if blocked[target]:
                        blocked[target] = False
                        queue.append(target)
            else:
                out.append(t)
                t += cost[s][3]
            p += 1
        ptr[r], clock[r] = p, t
        blocked[r] = p < n
    if any(blocked):
        raise_deadlock(schedule, encoded, ptr)
    return starts
