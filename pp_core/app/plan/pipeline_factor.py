"""How much more CPU a unit costs a rank of a running pipeline than it cost alone:
:func:`measure_pipeline_factor`.

The profile times every unit alone, one microbatch after another, in one quiet process. A CPU
rank of a pipeline pays more for the same units: activations of several microbatches in flight
(fresh pages, colder caches), the kernel's share of every hand-off, peers on the same cores:
more CPU per rank and step than its units' profiled F and B and the executor's per-action time
add up to, the part of the planner's under-prediction that no one collective or engine explains
(the figures: docs/benchmarks.md).

So ``pp-core plan --world N`` measures it once, on the model itself: ``min(N, 4)`` local
processes run the spec's model as a 1F1B pipeline (the profile's cost-balanced split, every
microbatch of the global batch) for a few steps and report their CPU seconds per step; the
factor is their sum over what a profile taken by the first of them just before predicts for
the same ranks (taken seconds apart, since a machine's speed drifts between minutes). The tp-1 profiles' times are scaled by it
(:meth:`pp_core.planning.costs.ModelProfile.scaled`) before the layouts are ranked: CPU time,
so the simulator still shares the cores out itself. A tp profile is left as measured: its tp
processes were already running together, and scaled it over-predicted (docs/benchmarks.md).
The processes are forked from the fork server ``pp-core run`` forks its ranks from
(:mod:`pp_core.app.launch.warm`), not spawned: torch imported once, not once per process.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pp_core.app.factories import build_dataset, build_model
from pp_core.app.launch import warm
from pp_core.app.spec import Spec
from pp_core.losses import resolve_loss
from pp_core.measure.helpers import HELPER_TIMEOUT_S, run_helpers
from pp_core.measure.profile import profile_model
from pp_core.planning.balance import split_by_profile
from pp_core.planning.costs import ModelProfile
from pp_core.runtime.build import build_pipeline

__all__ = ["measure_pipeline_factor", "MAX_RANKS", "BOUNDS"]

MAX_RANKS = 4
"""The most local processes that run the pipeline (more only measure how they queue)."""

BOUNDS = (0.5, 3.0)
"""A factor outside is a measurement gone wrong (a machine busy with something else): clipped."""

WARMUP, TIMED = 2, 8


def measure_pipeline_factor(spec: Spec, profiles: dict[int, ModelProfile], world: int,
                            backend: str = "gloo") -> float:
    """The factor for ``spec``'s model, ``profiles`` being its tp-1 profiles by microbatch
    size (the largest size that gives every rank a microbatch is run; its split and the
    executor's per-action time are used). 1.0 when fewer than 2 processes would run it."""
    batch = spec.global_batch_size
    ranks = min(world, MAX_RANKS, len(next(iter(profiles.values())).units))
    sizes = [s for s in sorted(profiles, reverse=True) if batch % s == 0 and batch // s >= ranks]
    if ranks < 2 or not sizes:
        return 1.0
    profile, size = profiles[sizes[0]], sizes[0]
    stages = split_by_profile(profile, ranks)
    with tempfile.TemporaryDirectory(prefix="pp-core-factor-") as tmp:
        out = os.path.join(tmp, "seconds")
        run_helpers(_worker, (spec.to_dict(), stages, size, backend,
                              os.path.join(tmp, "store"), out), ranks,
                    died="a process running the model as a pipeline ended before it finished "
                         "({}); nothing was planned (skip it with 'pp-core plan --no-link')",
                    failed="running the model as a pipeline to measure its CPU cost failed",
                    start_method="forkserver" if warm.start() else "spawn")  # torch imported
        with open(out, "rb") as fh:
            measured, alone = pickle.load(fh)
    predicted = _predicted_cpu_s(alone, profile.action_overhead_s, ranks, batch // size)
    return min(max(sum(measured) / predicted, BOUNDS[0]), BOUNDS[1]) if predicted > 0 else 1.0


def _predicted_cpu_s(alone: ModelProfile, action_overhead_s: float, ranks: int,
                     microbatches: int) -> float:
    """What the profile says the ranks spend per step: their units' F and B for every
    microbatch, and the executor's time on each of those actions."""
    compute = sum(u.forward_s + u.backward_s for u in alone.units)
    return microbatches * (compute + 2 * ranks * action_overhead_s)


def _worker(rank: int, values: dict, stages, microbatch_size: int, backend: str,
            store_path: str, out_path: str) -> None:
    """Rank 0 profiles the model alone while the others wait (the machine's speed drifts
    between minutes: both figures are taken within seconds), then all run the pipeline."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a spawned helper starts: plan ends us
    torch.set_num_threads(1)  # as a CPU rank of a small machine runs
    ranks = len(stages)
    dist.init_process_group(backend, store=dist.FileStore(store_path, ranks), rank=rank,
                            world_size=ranks, timeout=timedelta(seconds=HELPER_TIMEOUT_S))
    try:
        spec = Spec.from_dict(values)
        config = dataclasses.replace(
            spec.pipeline, pp_schedule="1f1b", pp_schedule_csv=None, layers_per_stage=None,
            module_fqns_per_model_part=stages, pp_batch_size=spec.global_batch_size,
            pp_microbatch_size=microbatch_size)
        inputs, target = next(iter(build_dataset(spec)))
        alone = None
        if rank == 0:
            alone = profile_model(build_model(spec), inputs, target,
                                  resolve_loss(config.loss_fn), [microbatch_size], repeats=5,
                                  config=config)[microbatch_size]
        dist.barrier()
        pipe = build_pipeline(build_model(spec), config)
        seconds = []
        for step in range(WARMUP + TIMED):
            dist.barrier()
            started = time.process_time()  # user and system, as measure.overhead
            pipe.step(inputs, target=target)
            seconds.append(time.process_time() - started)
            for part in pipe.model_parts:
                part.zero_grad(set_to_none=True)
        mine = torch.tensor([statistics.median(seconds[WARMUP:])], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(ranks)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            with open(out_path, "wb") as fh:
                pickle.dump(([t.item() for t in gathered], alone), fh)
    finally:
        dist.destroy_process_group()
