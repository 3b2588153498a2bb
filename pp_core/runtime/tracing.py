"""Per-rank action traces of a real step, merged into one Chrome/Perfetto trace.

Turn it on with ``pipe.tracing = True``: every step then records, on every rank, the start and
end of each action of the program (wall-clock seconds). :func:`gather_trace` collects them
(collective: call it on every rank of the pipeline), :func:`chrome_trace` lays them out - one
track per rank - next to the timeline :func:`pp_core.schedule.simulate.simulate` predicts from
the *same step's* mean F/B/I/W duration per stage, and reports each rank's measured bubble
(step time minus time spent computing) beside the predicted one. Open the file in
ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Optional

from pp_core.schedule.simulate import Costs, simulate

__all__ = ["gather_trace", "chrome_trace", "write_trace", "measured_costs"]

_COMPUTE = ("F", "B", "I", "W")


def _kind(name: str) -> str:
    stripped = name.lstrip("0123456789")
    for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        if stripped.startswith(kind):
            return kind
    return stripped[:1] if stripped[:1] in _COMPUTE else name


def gather_trace(pipe) -> list:
    """Every rank's ``(action, start, end)`` list of the last traced step, by rank."""
    events = list(pipe.last_trace or [])
    if pipe.group is None:
        return [events]
    import torch.distributed as dist

    gathered = [None] * pipe.num_ranks
    dist.all_gather_object(gathered, events, group=pipe.group)
    return gathered


def measured_costs(traces) -> dict:
    """Mean duration (s) of each compute kind per stage, from gathered traces."""
    sums: dict = defaultdict(lambda: [0.0, 0])
    for events in traces:
        for name, start, end in events:
            kind = _kind(name)
            if kind in _COMPUTE:
                stage = int(name[:len(name) - len(name.lstrip("0123456789"))])
                total = sums[(stage, kind)]
                total[0] += end - start
                total[1] += 1
    costs: dict = defaultdict(dict)
    for (stage, kind), (total, count) in sums.items():
        costs[stage][kind] = total / count
    return dict(costs)


def chrome_trace(traces, schedule=None) -> dict:
    """Measured tracks (pid 0) and, given the schedule, the simulator's prediction (pid 1)."""
    origin = min((start for events in traces for _, start, _ in events), default=0.0)
    events_out: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name",
                               "args": {"name": "measured"}}]
    summary: dict = {"measured_makespan_s": 0.0, "measured_busy_s": [],
                     "measured_bubble_s": []}
    end_all = max((end for events in traces for _, _, end in events), default=origin)
    summary["measured_makespan_s"] = end_all - origin
    for rank, events in enumerate(traces):
        events_out.append({"ph": "M", "pid": 0, "tid": rank, "name": "thread_name",
                           "args": {"name": f"rank {rank}"}})
        busy = 0.0
        for name, start, end in events:
            kind = _kind(name)
            if kind in _COMPUTE:
                busy += end - start
            events_out.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                               "ts": round((start - origin) * 1e6, 1),
                               "dur": round((end - start) * 1e6, 1)})
        summary["measured_busy_s"].append(busy)
        summary["measured_bubble_s"].append(summary["measured_makespan_s"] - busy)
    if schedule is not None and traces and any(traces):
        result = simulate(schedule, Costs(per_stage=measured_costs(traces)))
        summary["predicted_makespan_s"] = result.makespan
        summary["predicted_bubble_s"] = [result.makespan - b for b in result.busy]
        events_out.append({"ph": "M", "pid": 1, "name": "process_name",
                           "args": {"name": "predicted (simulator, measured costs)"}})
        for rank, row in enumerate(result.timeline):
            events_out.append({"ph": "M", "pid": 1, "tid": rank, "name": "thread_name",
                               "args": {"name": f"rank {rank}"}})
            for action, start, end in row:
                events_out.append({"name": str(action), "cat": action.kind.value, "ph": "X",
                                   "pid": 1, "tid": rank, "ts": round(start * 1e6, 1),
                                   "dur": round((end - start) * 1e6, 1)})
    return {"traceEvents": events_out, "displayTimeUnit": "ms", "otherData": summary}


def write_trace(pipe, path: str | os.PathLike) -> Optional[dict]:
    """Gather the last traced step (collective) and write it on the pipeline's rank 0.

    Returns the summary (measured and predicted makespan and bubbles) on rank 0, else None.
    """
    traces = gather_trace(pipe)
    if pipe.rank != 0:
        return None
    trace = chrome_trace(traces, pipe.schedule)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(trace, handle)
    return trace["otherData"]
