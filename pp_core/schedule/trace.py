"""Chrome/Perfetto trace JSON (chrome://tracing, ui.perfetto.dev): the one module that writes it.

Every trace pp-core writes is made here, from timed actions, so all of them look alike - one
complete event (``"ph": "X"``) per action, named by its compact form and grouped by the category
of :mod:`pp_core.schedule.labels`:

* :func:`chrome_trace` - a simulated timeline (``pp-core schedule simulate --trace``): one
  thread per rank; the simulator's time unit (one F at the default costs) maps to ``unit_us``
  microseconds, so the ruler reads in "F units" at the default of 1000 us = 1 ms;
* :func:`measured_trace` - one traced step of a real pipeline (``Pipeline.tracing``, gathered by
  :mod:`pp_core.runtime.tracing`): one thread per rank and, as a second process, what the
  simulator predicts for the schedule from the same step's mean F/B/I/W time per stage;
* :func:`run_trace` - the steps ``pp-core run`` recorded: one process per rank, compute on one
  thread, communication and waits on another.

Pure Python (no torch), like the rest of the schedule half: the runtime and the run recorder
hand it plain ``(name, start, end)`` records.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Optional

from pp_core.schedule.labels import COMM, KINDS, WAIT, category, colour, kind_of_label
from pp_core.schedule.simulate import Costs, simulate

__all__ = ["TraceBuilder", "chrome_trace", "measured_trace", "measured_costs", "run_trace",
           "write_chrome_trace", "write_json"]


class TraceBuilder:
    """Collects the events of one trace; times are microseconds from the trace's origin."""

    def __init__(self):
        self.events: list[dict] = []

    def process(self, pid: int, name: str, sort_index: Optional[int] = None) -> None:
        self.events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        if sort_index is not None:
            self.events.append({"ph": "M", "pid": pid, "name": "process_sort_index",
                                "args": {"sort_index": sort_index}})

    def thread(self, pid: int, tid: int, name: str, sort_index: Optional[int] = None) -> None:
        self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                            "args": {"name": name}})
        if sort_index is not None:
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                                "args": {"sort_index": sort_index}})

    def span(self, name: str, cat: str, pid: int, tid: int, start_us: float, dur_us: float,
             digits: int = 1, args: Optional[dict] = None, cname: Optional[str] = None) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                 "ts": round(start_us, digits), "dur": round(dur_us, digits)}
        if cname is not None:
            event["cname"] = cname
        if args is not None:
            event["args"] = args
        self.events.append(event)

    def trace(self, other: Optional[dict] = None) -> dict:
        trace = {"traceEvents": self.events, "displayTimeUnit": "ms"}
        if other is not None:
            trace["otherData"] = other
        return trace


def _timeline(builder: TraceBuilder, pid: int, timeline, unit_us: float, digits: int,
              names: list[str], details: bool = False) -> None:
    """The simulator's rows (``[(action, start, end), ...]`` per rank) as threads of ``pid``;
    ``details``: each span's stage, microbatch and kind as args, coloured by kind."""
    for rank, name in enumerate(names):
        builder.thread(pid, rank, name, sort_index=rank if details else None)
    for rank, row in enumerate(timeline):
        for action, start, end in row:
            kind = action.kind.value
            builder.span(str(action), category(kind), pid, rank, start * unit_us,
                         (end - start) * unit_us, digits,
                         args={"stage": action.stage, "microbatch": action.microbatch,
                               "kind": kind} if details else None,
                         cname=colour(kind) if details else None)


def chrome_trace(result, unit_us: float = 1000.0) -> dict:
    """A :class:`~pp_core.schedule.simulate.SimResult` as a JSON-able trace dict."""
    schedule = result.schedule
    builder = TraceBuilder()
    builder.process(0, f"schedule {schedule.name}")
    names = [f"rank {rank} (stages {','.join(map(str, schedule.stages_of(rank)))})"
             for rank in range(schedule.num_ranks)]
    _timeline(builder, 0, result.timeline, unit_us, 3, names, details=True)
    return builder.trace({key: str(value) for key, value in result.to_dict().items()
                          if key in ("schedule", "pp", "num_stages", "microbatches", "makespan",
                                     "bubble_ratio", "peak_activations")})


def write_chrome_trace(result, path: str | os.PathLike, unit_us: float = 1000.0) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    write_json(chrome_trace(result, unit_us), path)


def write_json(trace: dict, path: str | os.PathLike) -> None:
    """Write a trace dict to ``path``, making its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(trace, handle)


def measured_costs(traces) -> dict:
    """Mean duration (s) of each compute kind per stage: ``{stage: {"F": s, ...}}``, from
    per-rank ``[(name, start, end), ...]`` lists."""
    sums: dict = defaultdict(lambda: [0.0, 0])
    for events in traces:
        for name, start, end in events:
            kind = kind_of_label(name)
            if kind in KINDS:
                total = sums[(int(name[:len(name) - len(name.lstrip("0123456789"))]), kind)]
                total[0] += end - start
                total[1] += 1
    costs: dict = defaultdict(dict)
    for (stage, kind), (total, count) in sums.items():
        costs[stage][kind] = total / count
    return dict(costs)


def measured_trace(traces, schedule=None) -> dict:
    """One traced step: measured tracks (pid 0) from per-rank ``[(name, start, end), ...]``
    (seconds) and, given the schedule, the simulator's prediction with the step's own costs
    (pid 1). ``otherData`` holds the measured and predicted makespan and bubbles."""
    origin = min((start for events in traces for _, start, _ in events), default=0.0)
    end_all = max((end for events in traces for _, _, end in events), default=origin)
    builder = TraceBuilder()
    builder.process(0, "measured")
    summary: dict = {"measured_makespan_s": end_all - origin, "measured_busy_s": [],
                     "measured_bubble_s": []}
    for rank, events in enumerate(traces):
        builder.thread(0, rank, f"rank {rank}")
        busy = 0.0
        for name, start, end in events:
            kind = kind_of_label(name)
            if kind in KINDS:
                busy += end - start
            builder.span(name, WAIT if kind == name else category(kind), 0, rank,
                         (start - origin) * 1e6, (end - start) * 1e6)
        summary["measured_busy_s"].append(busy)
        summary["measured_bubble_s"].append(summary["measured_makespan_s"] - busy)
    if schedule is not None and traces and any(traces):
        result = simulate(schedule, Costs(per_stage=measured_costs(traces)))
        summary["predicted_makespan_s"] = result.makespan
        summary["predicted_bubble_s"] = [result.makespan - b for b in result.busy]
        builder.process(1, "predicted (simulator, measured costs)")
        _timeline(builder, 1, result.timeline, 1e6, 1,
                  [f"rank {rank}" for rank in range(len(result.timeline))])
    return builder.trace(summary)


def run_trace(ranks: list[dict]) -> dict:
    """``pp-core run``'s recorded steps: per rank a dict with ``rank``, ``pp_rank``, ``dp_rank``,
    ``stages`` and ``events`` = ``[(name, category, start, end, step), ...]`` (seconds)."""
    builder = TraceBuilder()
    origin = min((e[2] for r in ranks for e in r["events"]), default=0.0)
    for figures in ranks:
        pid = figures["rank"]
        builder.process(pid, f"rank {pid} (pp {figures['pp_rank']}, dp {figures['dp_rank']}, "
                             f"stages {','.join(map(str, figures['stages']))})", sort_index=pid)
        for name, cat, start, end, step in figures["events"]:
            builder.span(name, cat, pid, 1 if cat in (COMM, WAIT) else 0,
                         (start - origin) * 1e6, (end - start) * 1e6, args={"step": step})
    return builder.trace()
