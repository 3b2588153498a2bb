"""Discrete-event simulation of a compute-only schedule: makespan, bubble, memory.

Each rank executes its actions in order; an action starts at ``max(rank free, end of its input +
comm latency)`` with the dependency rule of validation (:mod:`pp_core.schedule.replay`: in a
chain ``F(s,k)`` needs ``F(s-1,k)``, ``I/B(s,k)`` needs ``I/B(s+1,k)``), the model the published
bubble formulas assume, so with unit costs the results match them (docs/schedules.md, "Bubble
ratio"). The run is the walk of validation with a clock, linear in the number of actions.

Figures:

* **bubble** (makespan bubble): ``max over ranks of (makespan - busy)``; ``bubble_ratio`` =
  bubble / makespan.
* **span bubble**: ``max over ranks of (last end - first start - busy)`` (the ZB papers' figure;
  it ignores the staggered start that only overlaps a previous iteration).
* **peak in-flight activations** per rank: max number of ``(stage, microbatch)`` pairs whose F
  has started and whose B (or W, when the backward is split) has not finished (with sequence
  slices, ``Schedule.seq_chunks = K``, a slice counts ``1/K`` and costs ``1/K`` of each action's
  cost: the figures stay in microbatches and are comparable across K); in bytes too when
  ``activation_bytes`` (per stage) is given, plus, with ``input_grad_held_bytes``, what a split
  backward's I adds until its W (the gradients W restarts from).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pp_core.errors import ScheduleError
from pp_core.schedule.ir import Action, Schedule
from pp_core.schedule.build import gc_paused
from pp_core.schedule.peak_bytes import bytes_per_stage, rank_peak_bytes
from pp_core.schedule.replay import F_CODE, I_CODE, MAKES, Dependencies, columns, decode
from pp_core.schedule.sharing import replay_shared
from pp_core.schedule.deadlock import walk_or_raise
from pp_core.schedule.validate import encode_validated

__all__ = ["Costs", "SimResult", "simulate"]


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
            stages, kinds = columns(row, M)
            ends = self._ends[r] if self._ends is not None else \
                [t0 + self._cost[s][k] for s, k, t0 in zip(stages, kinds, starts)]
            out.append([(decode(c, M), t0, t1) for c, t0, t1 in zip(row, starts, ends)])
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
            "microbatches": s.num_sequences,
            "seq_chunks": s.seq_chunks,
            "costs": self.costs.to_dict(),
            "comm_latency": _num(self.comm_latency),
            "processors": None if self.processors is None else _num(self.processors),
            "makespan": _num(self.makespan),
            "bubble": _num(self.bubble),
            "bubble_ratio": round(self.bubble_ratio, 6),
            "span_bubble": _num(self.span_bubble),
            "busy": [_num(b) for b in self.busy],
            "idle": [_num(i) for i in self.idle],
            "peak_activations": [_num(p) for p in self.peak_activations],
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
    *,
    slice_costs: bool = False,
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
    :param slice_costs: with sequence slices, ``costs`` and the bytes are already one slice's
        (a planner's per-slice profile, :meth:`~pp_core.planning.costs.ModelProfile.sliced`),
        not a whole microbatch's to be shared out.
    """
    costs = Costs() if costs is None else costs
    if isinstance(comm_latency, bool) or not isinstance(comm_latency, (int, float)) \
            or comm_latency < 0:
        raise ScheduleError(f"comm_latency must be a number >= 0, got {comm_latency!r}")
    if processors is not None and (isinstance(processors, bool) or not isinstance(
            processors, (int, float)) or not processors > 0):
        raise ScheduleError(f"processors must be a number > 0 (or None), got {processors!r}")
    held = bytes_per_stage(input_grad_held_bytes, schedule.num_stages, "input_grad_held_bytes")
    stage_bytes = bytes_per_stage(activation_bytes if held is None or activation_bytes is not None
                               else 0.0, schedule.num_stages)
    cost = costs.table(schedule.num_stages)
    K = schedule.seq_chunks
    if K > 1 and not slice_costs:  # the costs are a whole microbatch's: a slice takes its share
        cost = [tuple(c / K for c in row) for row in cost]
        stage_bytes = None if stage_bytes is None else [b / K for b in stage_bytes]
        held = None if held is None else [b / K for b in held]
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
        stages, kinds = columns(row, M)
        for stage, kind in zip(stages, kinds):
            if uniform:
                counts[kind] += 1
            else:
                total += cost[stage][kind]
            if kind == F_CODE:
                live += 1
                if live > peak:
                    peak = live
            elif kind != I_CODE:  # a B, or the W after an I, frees the unit's activations
                live -= 1
        if uniform:
            total = sum(n * d for n, d in zip(counts, cost[0]))
        busy.append(total)
        first.append(st[0] if st else 0.0)
        if not st:
            last.append(0.0)
        else:  # shared processors stretch actions: their ends are the replay's own
            last.append(ends[r][-1] if ends is not None else st[-1] + cost[stages[-1]][kinds[-1]])
        peaks.append(peak if K == 1 else peak / K)  # in microbatches, slices counted as 1/K
        if stage_bytes is not None:
            peak_bytes.append(rank_peak_bytes(row, M, stage_bytes, held))
    return SimResult(
        schedule=schedule, costs=costs, comm_latency=float(comm_latency),
        makespan=max(last), busy=busy, first_start=first, last_end=last,
        peak_activations=peaks,
        peak_activation_bytes=peak_bytes if stage_bytes is not None else None,
        processors=float(processors) if ends is not None else None, starts=starts,
        _encoded=encoded, _cost=cost, _ends=ends,
    )


def _replay(schedule: Schedule, encoded: list[list[int]], cost,
            latency: float) -> list[list[float]]:
    """Start time of every encoded action: each starts when its rank is free and its inputs
    have arrived (``latency`` after they were made on another rank)."""
    dependencies = Dependencies(schedule)
    arrivals = dependencies.arrivals
    ends = [0.0] * (2 * schedule.num_stages * schedule.num_microbatches)  # per unit and made
    clock = [0.0] * len(encoded)
    starts: list[list[float]] = [[] for _ in encoded]

    place = dependencies.place

    def visit(r: int, _code: int, key: int, stage: int, kind: int) -> None:
        t = clock[r]
        at = 2 * key
        for offset in arrivals[kind][place(key)]:
            ready = ends[at + offset] + latency
            if ready > t:
                t = ready
        starts[r].append(t)
        t += cost[stage][kind]
        made = MAKES[kind]
        if made is not None:
            ends[at + made] = t
        clock[r] = t

    walk_or_raise(schedule, encoded, visit, dependencies)
    return starts
