"""Time the collectives a layout adds, on this machine: :func:`measure_collectives`.

The layout search costs dp, FSDP2 and expert-parallel traffic with
:class:`~pp_core.planning.collectives.Collectives`, fitted here: a few short-lived local
processes (:func:`pp_core.measure.helpers.run_helpers`, the run's backend, one thread each as a
CPU rank runs) time every kind at a small and a large message, for a group of 2 and for the
largest group asked (at most :data:`MAX_GROUP`), :data:`REPEATS` times each; the slowest rank's
median counts. The same processes then time the data-parallel engine's own work
(:mod:`pp_core.measure.engine`). A few seconds, once per ``pp-core plan`` call.
"""

from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pp_core.measure.helpers import HELPER_TIMEOUT_S, run_helpers
from pp_core.parallel.dims import ParallelDims
from pp_core.measure.engine import time_engine
from pp_core.planning.collectives import KINDS, Collectives, EngineCosts, fit

__all__ = ["measure_collectives", "time_collectives", "MAX_GROUP", "SIZES", "REPEATS"]

MAX_GROUP = 4
"""The largest group timed (even: its ranks are also timed in pairs): more local processes than that on a small machine measure only
how they share its cores; larger groups reuse the fit (the ring factors carry the size)."""

REPEATS = 15
"""Timings per kind and size: a collective's wait for peers not yet scheduled varies from one
call to the next, and with 5 the fits of two calls a minute apart were 2-6x apart."""

SIZES = (256, 1 << 18)
"""float32 elements of the small and the large message (1 KiB, 1 MiB)."""


def measure_collectives(largest_group: int, backend: str = "gloo", device: str = "cpu",
                        repeats: int = REPEATS) -> Collectives:
    """The fits for groups of 2 and the largest even group up to ``largest_group`` and
    :data:`MAX_GROUP` (none below 2)."""
    group = min(largest_group, MAX_GROUP)
    group -= group % 2  # timed in pairs too: an odd group uses the fit below it
    if group < 2:
        return Collectives()
    with tempfile.TemporaryDirectory(prefix="pp-core-coll-") as tmp:
        out = os.path.join(tmp, "fits")
        run_helpers(_worker, (group, os.path.join(tmp, "store"), backend, device, out, repeats),
                    group, died="a process timing collectives ended before it finished ({})",
                    failed="timing the collectives between local processes failed")
        with open(out, "rb") as fh:
            return pickle.load(fh)


def time_collectives(group, device: torch.device, repeats: int = REPEATS,
                     compute_s: float = 2e-3) -> dict:
    """``{(kind, size): (latency_s, bytes_per_s)}`` over ``group`` (every rank of it calls
    this); the slowest rank's median of ``repeats`` after one warm-up, per kind and size.

    Each rank computes ``compute_s`` of matmuls before each collective, as a rank of a step
    does: where the ranks outnumber the cores, a collective then also waits for peers the
    scheduler has not run yet - what it costs a run, not an idle group
    (:func:`pp_core.measure.link.measure_p2p_busy` times a hand-off the same way)."""
    size = dist.get_world_size(group)
    work = torch.randn(64, 64, device=device)
    found = torch.zeros(len(KINDS), len(SIZES), dtype=torch.float64)
    for k, kind in enumerate(KINDS):
        for s, numel in enumerate(SIZES):
            numel -= numel % size  # shards of equal size
            run = _collective(kind, numel, size, group, device)
            times = []
            for _ in range(repeats + 1):
                dist.barrier(group=group)
                _compute(work, compute_s)  # as in a step: the peers arrive from compute
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            found[k, s] = statistics.median(times[1:])
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return {(kind, size): fit(kind, size, (SIZES[0] * 4, found[k, 0].item()),
                              (SIZES[1] * 4, found[k, 1].item()))
            for k, kind in enumerate(KINDS)}


def _compute(work, seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        work @ work
    if work.device.type == "cuda":
        torch.cuda.synchronize(work.device)


def _collective(kind: str, numel: int, size: int, group, device):
    """A call running ``kind`` on a tensor of ``numel`` float32 elements (whole, unsharded)."""
    whole = torch.ones(numel, device=device)
    shard = torch.ones(numel // size, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if kind == "all_gather":  # torch 2.13 renames *_into_tensor / *_tensor to *_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(whole, shard, group=group)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, whole, group=group)
    out = torch.empty_like(whole)
    return lambda: dist.all_to_all_single(out, whole, group=group)


def _worker(rank: int, size: int, store_path: str, backend: str, device_type: str,
            out_path: str, repeats: int) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size, timeout=timedelta(seconds=HELPER_TIMEOUT_S))
    try:
        # pairs as a run's dp groups pair ranks (every pair at once), built where every
        # group is built (ParallelDims)
        meshes = ParallelDims(pp=size // 2, dp_replicate=2).build(device.type)
        fits = time_collectives(meshes.mesh["dp_replicate"].get_group(), device, repeats)
        dist.barrier()
        if size > 2:
            fits.update(time_collectives(dist.group.WORLD, device, repeats))
        engine = time_engine(meshes.mesh["dp_replicate"]) if device.type == "cpu" \
            else EngineCosts()  # (on a GPU the hooks overlap the kernels: not timed)
        if rank == 0:
            with open(out_path, "wb") as fh:
                pickle.dump(Collectives(fits, engine), fh)
    finally:
        dist.destroy_process_group()
