"""Per-rank action traces of a real step, gathered from every rank and written as one trace.

Turn it on with ``pipe.tracing = True``: every step then records, on every rank, the start and
end of each action of the program (wall-clock seconds; an :class:`~pp_core.runtime.observers.
ActionTrace` observer). :func:`gather_trace` collects them (collective: call it on every rank of
the pipeline); :func:`pp_core.schedule.trace.measured_trace` lays them out - one track per rank -
next to the timeline :func:`pp_core.schedule.simulate.simulate` predicts from the *same step's*
mean F/B/I/W duration per stage, and reports each rank's measured bubble (step time minus time
spent computing) beside the predicted one. Open the file in ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import os
from typing import Optional

from pp_core.schedule.trace import measured_costs, measured_trace, write_json

# chrome_trace: this module's name for measured_trace before the trace format had one module
__all__ = ["gather_trace", "chrome_trace", "write_trace", "measured_costs"]

chrome_trace = measured_trace


def gather_trace(pipe) -> list:
    """Every rank's ``(action, start, end)`` list of the last traced step, by rank."""
    events = list(pipe.last_trace or [])
    if pipe.group is None:
        return [events]
    import torch.distributed as dist  # lazy: torch.distributed, only with a process group

    gathered = [None] * pipe.num_ranks
    dist.all_gather_object(gathered, events, group=pipe.group)
    return gathered


def write_trace(pipe, path: str | os.PathLike) -> Optional[dict]:
    """Gather the last traced step (collective) and write it on the pipeline's rank 0.

    Returns the summary (measured and predicted makespan and bubbles) on rank 0, else None.
    """
    traces = gather_trace(pipe)
    if pipe.rank != 0:
        return None
    trace = measured_trace(traces, pipe.schedule)
    write_json(trace, path)
    return trace["otherData"]
