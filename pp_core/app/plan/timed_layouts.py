"""One layout per tp / ep degree pair timed by a short run: :func:`time_layouts`.

The layout search predicts every layout by arithmetic on measured parts (the profile, the
link, the collectives, the data-parallel engine, the pipeline factor). Two things the parts do
not hold move the step of a CPU layout whose processes outnumber the cores:

* ranks that meet inside every block - a tp stage all-reduces in every block, an ep layer
  all-to-alls in every MoE layer - wait at each collective for a peer the scheduler is not
  running, which no part timed apart shows;
* the machine's speed drifts from one minute to the next, and each of those parts was measured
  at its own minute (the figures of both: docs/benchmarks.md).

So where the whole world runs on this machine (at most :data:`MAX_WORLD` CPU processes),
``pp-core plan --world N`` runs, for each degree pair ``(tp, ep)`` of the planned layouts, the
one with the most pipeline stages - its best plan, written as ``-o`` writes it, through the
same training loop as ``pp-core run`` - for a few steps, one pair right after the other, and
multiplies the predicted step of every plan at those degrees by that run's measured over
predicted step (:func:`calibrated`; clipped to :data:`BOUNDS`). The arithmetic still ranks the
plans of a layout and the layouts of a pair; the run sets the pair's level. Each pair runs
twice (:func:`time_layouts`); what each run measured is in the plan's JSON (``timed_layouts``)
and table. The processes of each run are forked from the fork server ``pp-core run`` forks its
ranks from (:mod:`pp_core.app.launch.warm`: torch and the training loop imported once), not
spawned: a run of 4 spawned processes spent seconds of every core importing torch, 4-6 runs
per plan.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch.distributed as dist

from pp_core.app.launch import warm
from pp_core.measure.helpers import HELPER_TIMEOUT_S, run_helpers
from pp_core.parallel.dims import ParallelDims

__all__ = ["TimedLayout", "timed_degrees", "time_layouts", "calibrated", "time_layout",
           "MAX_WORLD", "BOUNDS"]

MAX_WORLD = 4
"""The largest world timed by a run here (more local processes only measure how they queue)."""

BOUNDS = (0.25, 10.0)
"""A factor outside is a run gone wrong (a machine busy with something else): clipped. Wide,
since a tp layout with more processes than cores runs several times its arithmetic."""

WARMUP, TIMED = 2, 6


@dataclass(frozen=True)
class TimedLayout:
    """The layout run for its ``(tp, ep)`` pair: its best plan's predicted and measured step."""

    dims: ParallelDims
    predicted_step_s: float
    measured_step_s: float

    @property
    def factor(self) -> float:
        low, high = BOUNDS
        return min(max(self.measured_step_s / self.predicted_step_s, low), high)

    def to_dict(self) -> dict:
        return {"tp_size": self.dims.tp, "ep_size": self.dims.ep,
                "layout": self.dims.describe(), "dp_shard": self.dims.dp_shard,
                "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s, "factor": self.factor}


def timed_degrees(admitted: Iterable[ParallelDims]) -> dict[tuple[int, int], ParallelDims]:
    """``{(tp, ep): the layout run for it}``: of the admitted layouts at those degrees, the one
    with the most pipeline stages (the first of equals)."""
    found: dict[tuple[int, int], ParallelDims] = {}
    for dims in admitted:
        key = (dims.tp, dims.ep)
        if key not in found or dims.pp > found[key].pp:
            found[key] = dims
    return found


def time_layouts(layouts: dict[tuple[int, int], object], world: int, backend: str,
                 written: Callable[[object], dict]) -> dict[tuple[int, int], TimedLayout]:
    """Each planned layout of ``layouts`` (a :class:`~pp_core.app.plan.plan_world.LayoutPlan`)
    run as ``written(layout)`` says, by ``world`` local processes: every layout once, then
    every layout again, the second round counting - the first run after the profiles took
    1.4x its repeat a few seconds later (whatever the measuring before it left behind)."""
    values = {key: written(planned) for key, planned in layouts.items()}
    for key in layouts:
        time_layout(values[key], world, backend)
    return {key: TimedLayout(planned.dims, planned.best.predicted_step_s,
                             time_layout(values[key], world, backend))
            for key, planned in layouts.items()}


def calibrated(ranking, factor: float) -> None:
    """Every plan of ``ranking`` (its layout's) predicted ``factor`` times as long, in place."""
    if factor == 1.0:
        return
    for candidate in ranking.kept + ranking.dropped:
        if candidate.predicted_step_s is not None:
            candidate.predicted_step_s *= factor
            candidate.optimizer_step_s *= factor


def time_layout(values: dict, world: int, backend: str = "gloo") -> float:
    """The median step time of the pipeline ``values`` (a spec's dict at fixed degrees) over
    :data:`TIMED` steps after :data:`WARMUP`, run by ``world`` local processes."""
    values = json.loads(json.dumps(values))
    values.pop("checkpoint", None)  # nothing loaded, saved or exported
    values["train"].update(steps=WARMUP + TIMED, log_every=1, eval_every=None)
    with tempfile.TemporaryDirectory(prefix="pp-core-timed-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        values["output"] = {"metrics": metrics, "progress": "off", "summary": False}
        run_helpers(_worker, (values, world, backend, os.path.join(tmp, "store")), world,
                    died="a process running a layout to time it ended before it finished "
                         "({}); nothing was planned (skip it with 'pp-core plan --no-link')",
                    failed="running a layout to time it failed",
                    start_method="forkserver" if warm.start() else "spawn")
        with open(metrics) as fh:
            rows = [json.loads(line) for line in fh if '"step_time_s"' in line]
    return statistics.median(r["step_time_s"] for r in rows if r["step"] > WARMUP)


def _worker(rank: int, values: dict, world: int, backend: str, store_path: str) -> None:
    """One rank of :func:`time_layout`: the training loop of ``pp-core run``, on a process
    group over a file store (no port)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a spawned helper starts: plan ends us
    from pp_core.app.rank import train  # lazy: the training loop, in the helpers only
    from pp_core.app.spec import Spec  # lazy: as train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=HELPER_TIMEOUT_S))
    try:
        train(Spec.from_dict(values))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
