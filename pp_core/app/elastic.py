"""Shrink, and grow back: the layout a run with ``distributed.nnodes: "MIN:MAX"`` takes at the
world size torch's elastic agent gave it.

The file's degrees are the layout of the whole run, on ``MAX`` nodes. When a node is lost, the
agent (c10d rendezvous, ``min_nodes=MIN``) re-forms the group with the survivors and starts every
rank again; each rank reads the world it was given (``WORLD_SIZE``: the same under ``pp-core run``
and under ``torchrun``) and goes on at :func:`refit` of it:

* ``pp_size``, ``tp_size`` and ``ep_size`` are kept, and with them the split, the schedule and
  the tensor- and expert-parallel plans;
* the data-parallel degree follows the world, by one rule: ``dp_replicate`` (replicas of the
  pipeline) changes, ``dp_shard`` is kept (with HSDP a replica's shard group is what a node
  holds); a run with ``dp_shard`` alone (FSDP, no replicas) changes ``dp_shard``;
* the global batch is kept: ``pipeline.pp_batch_size`` is per replica, so it grows by the factor
  the dp degree shrank (each replica runs more microbatches of the same size), the dataset yields
  the same batches and a token-normalised loss is the one the full world computes.

When nodes come back, the agent restarts the group at the larger world and the same rule grows
dp back. A world that cannot hold one replica, or cannot share the global batch in whole
microbatches, ends the run with one message (:func:`fit_world`). With ``distributed.layout:
auto`` none of the above: the whole layout was planned at launch for each world the run may be
given (:mod:`pp_core.app.elastic_layouts`), and the rank takes its world's. Pure arithmetic, no
torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from pp_core.errors import PipelineError
from pp_core.parallel.dims import ParallelDims

__all__ = ["changing_degree", "replica_ranks", "replica_formula", "refit", "fit_world",
           "apply_entry", "worlds_of"]


def changing_degree(dims: ParallelDims) -> str:
    """The dp degree that follows the world: ``dp_replicate``, unless only ``dp_shard`` is > 1."""
    return "dp_shard" if dims.dp_shard > 1 and dims.dp_replicate == 1 else "dp_replicate"


def _dp_step(dims: ParallelDims) -> int:
    """The dp degree changes in multiples of this: a kept shard group, and whole ep blocks."""
    kept = dims.dp_shard if changing_degree(dims) == "dp_replicate" else 1
    return math.lcm(kept, dims.ep)


def replica_ranks(dims: ParallelDims) -> int:
    """The ranks of the smallest world the run can go on at (one pipeline replica)."""
    return dims.pp * dims.tp * _dp_step(dims)


def replica_formula(dims: ParallelDims) -> str:
    """How :func:`replica_ranks` multiplies, by the keys' names."""
    kept = dims.dp_shard if changing_degree(dims) == "dp_replicate" else 1
    if kept > 1 and dims.ep > 1:
        return "pp_size x tp_size x lcm(dp_shard, ep_size)"
    return "pp_size x tp_size x " + ("dp_shard" if kept > 1 else "ep_size")


def refit(dims: ParallelDims, pp_batch_size: int, pp_microbatch_size: int,
          world: int) -> tuple[ParallelDims, int]:
    """The degrees and ``pp_batch_size`` of the run at ``world`` ranks; ``ValueError`` saying
    why it cannot go on there (the reason only: callers name the key)."""
    unit = replica_ranks(dims)
    if world > dims.world_size:
        raise ValueError(f"more than the {dims.world_size} the degrees are written for "
                         f"({dims.formula(expanded=True)}); the file's degrees are the whole "
                         f"run's, at MAX nodes")
    if world < unit or world % unit:
        raise ValueError(f"which cannot hold whole pipeline replicas of "
                         f"{replica_formula(dims)} = {unit} ranks")
    dp = world // (dims.pp * dims.tp)
    degree = changing_degree(dims)
    kept = dims.dp_shard if degree == "dp_replicate" else dims.dp_replicate
    fitted = replace(dims, **{degree: dp // kept})
    global_batch = pp_batch_size * dims.dp
    if global_batch % dp or (global_batch // dp) % pp_microbatch_size:
        raise ValueError(f"whose dp {dp} cannot share the global batch of {global_batch} "
                         f"samples (pipeline.pp_batch_size x dp = {pp_batch_size} x {dims.dp}) "
                         f"in whole microbatches of pp_microbatch_size {pp_microbatch_size}")
    return fitted, global_batch // dp


def fit_world(spec, world: int | None = None):
    """``spec`` at the world this rank was started in (``$WORLD_SIZE``), and the line that says
    so (``None`` when nothing changed). Only an elastic run (``nnodes: "MIN:MAX"``) changes; a
    world it cannot go on at raises :class:`~pp_core.PipelineError` with one message."""
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", spec.dims.world_size))
    dist, dims = spec.distributed, spec.dims
    if dist.elastic and dist.layout == "auto":
        return _planned_world(spec, world)
    if not dist.elastic or world == dims.world_size:
        return spec, None
    config = spec.pipeline
    try:
        fitted, batch = refit(dims, config.pp_batch_size, config.pp_microbatch_size, world)
    except ValueError as why:
        raise PipelineError(f"distributed.nnodes: {dist.nnodes!r}: the rendezvous gave {world} "
                            f"rank(s), {why}; the run ends here: start it again once enough "
                            f"nodes are back (it resumes from the latest checkpoint with "
                            f"checkpoint.resume: true)") from None
    degree = changing_degree(dims)
    spec = spec.with_("distributed", dp_replicate=fitted.dp_replicate, dp_shard=fitted.dp_shard,
                      dp_size=fitted.dp,
                      world_size=None if dist.world_size is None else world)
    spec = spec.with_("pipeline", pp_batch_size=batch)
    note = (f"the rendezvous gave {world} of {dims.world_size} ranks: going on at "
            f"{fitted.describe()} ({degree} {getattr(dims, degree)} -> "
            f"{getattr(fitted, degree)}; pp_batch_size {config.pp_batch_size} -> {batch} per "
            f"replica, the global batch of {batch * fitted.dp} kept)")
    return spec, note


def _planned_world(spec, world: int):
    """``layout: auto``: the layout planned at launch for ``world`` ranks
    (:mod:`pp_core.app.elastic_layouts`), and the line that says so when it is not the whole
    world's."""
    dist = spec.distributed
    table = (spec.prediction or {}).get("layouts") or {}
    if str(world) not in table:
        raise PipelineError(f"distributed.layout: auto: the rendezvous gave {world} rank(s), a "
                            f"world no layout was planned for at launch (planned: "
                            f"{', '.join(table) or 'none'}); start every node with the same "
                            f"nproc_per_node")
    fitted = apply_entry(spec, table[str(world)], table)
    if world == dist.world_size:
        return fitted, None
    planned = fitted.prediction
    return fitted, (f"the rendezvous gave {world} of {dist.world_size} ranks: re-planned for "
                    f"{world} (distributed.layout: auto): going on at {planned['layout']}, "
                    f"{planned['schedule']}, microbatches of {planned['microbatch_size']} "
                    f"(pp_batch_size {spec.pipeline.pp_batch_size} -> "
                    f"{fitted.pipeline.pp_batch_size} per replica, the global batch of "
                    f"{fitted.global_batch_size} kept; predicted step "
                    f"{planned['predicted_step_s'] * 1e3:.1f} ms)")


def apply_entry(spec, entry: dict, table: dict):
    """``spec`` at one planned layout (an entry of the table of
    :mod:`pp_core.app.elastic_layouts`), the table kept for a later world."""
    degrees = entry["degrees"]
    placed = spec.with_("distributed", **degrees,
                        dp_size=degrees["dp_replicate"] * degrees["dp_shard"])
    placed = placed.with_("pipeline", **entry["pipeline"])
    placed = placed.with_("train", activation_checkpointing=entry["activation_checkpointing"])
    return replace(placed, prediction={**entry["prediction"], "layouts": table})


def worlds_of(dist) -> list[int]:
    """The world sizes an elastic run may be given: ``MIN..MAX`` nodes of ``world_size / MAX``
    processes each (or ``nproc_per_node``)."""
    per_node = dist.nproc_per_node or max(1, dist.world_size // dist.max_nodes)
    return [nodes * per_node for nodes in range(dist.min_nodes, dist.max_nodes + 1)]
