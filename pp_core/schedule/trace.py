"""Export a simulated timeline as Chrome/Perfetto trace JSON (chrome://tracing, ui.perfetto.dev).

One process (the schedule), one thread per rank, one complete event (``"ph": "X"``) per action.
The simulator's time unit (one F at the default costs) maps to ``unit_us`` microseconds, so the
trace viewer's ruler reads in "F units" at the default of 1000 us = 1 ms.
"""

from __future__ import annotations

import json
import os

from pp_core.schedule.simulate import SimResult

__all__ = ["chrome_trace", "write_chrome_trace"]

# Chrome's reserved colour names, so every viewer shows F/B/I/W distinctly.
_COLOURS = {"F": "thread_state_running", "B": "rail_response", "I": "thread_state_iowait",
            "W": "rail_idle"}
_LABELS = {"F": "forward", "B": "backward", "I": "backward (input grads)",
           "W": "backward (weight grads)"}


def chrome_trace(result: SimResult, unit_us: float = 1000.0) -> dict:
    """The trace as a JSON-able dict (``{"traceEvents": [...], ...}``)."""
    schedule = result.schedule
    events: list[dict] = [
        {"ph": "M", "pid": 0, "name": "process_name",
         "args": {"name": f"schedule {schedule.name}"}},
    ]
    for rank in range(schedule.num_ranks):
        stages = ",".join(map(str, schedule.stages_of(rank)))
        events.append({"ph": "M", "pid": 0, "tid": rank, "name": "thread_name",
                       "args": {"name": f"rank {rank} (stages {stages})"}})
        events.append({"ph": "M", "pid": 0, "tid": rank, "name": "thread_sort_index",
                       "args": {"sort_index": rank}})
    for rank, row in enumerate(result.timeline):
        for action, start, end in row:
            kind = action.kind.value
            events.append({
                "name": str(action), "cat": _LABELS[kind], "ph": "X", "pid": 0, "tid": rank,
                "ts": round(start * unit_us, 3), "dur": round((end - start) * unit_us, 3),
                "cname": _COLOURS[kind],
                "args": {"stage": action.stage, "microbatch": action.microbatch, "kind": kind},
            })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {key: str(value) for key, value in result.to_dict().items()
                      if key in ("schedule", "pp", "num_stages", "microbatches", "makespan",
                                 "bubble_ratio", "peak_activations")},
    }


def write_chrome_trace(result: SimResult, path: str | os.PathLike, unit_us: float = 1000.0) -> None:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(chrome_trace(result, unit_us), fh)
