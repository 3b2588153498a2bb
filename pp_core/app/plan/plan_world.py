"""``pp-core plan FILE --world N``: the whole layout chosen, not only the schedule.

Every factorisation of N the model admits (:func:`pp_core.measure.layouts.enumerate_layouts`)
gets the per-layout search that ``pp-core plan`` runs at fixed degrees - schedule, stages per
rank, microbatch size, split and activation checkpointing per stage
(:func:`pp_core.planning.choose.choose_plan`) - on a profile adjusted to the layout
(:func:`pp_core.measure.layout_costs.layout_profile`); the plans are ranked together by
predicted step time under the memory cap.

What is measured, once per call: the model's units at every tp degree the layouts use (a tp
stage by its tp processes, collectives included, as :func:`pp_core.app.launch.decide.plan_spec`
profiles it), the point-to-point link, and the collectives that dp, FSDP2 and ep add
(:func:`pp_core.measure.collectives.measure_collectives`), and on CPU ranks how much more a
unit costs inside a running pipeline than alone (:mod:`pp_core.app.plan.pipeline_factor`:
the tp-1 profile's times are scaled by it). Where the whole world runs on this machine, one
layout per tp / ep degree pair is then run a few steps and sets that pair's level
(:mod:`pp_core.app.plan.timed_layouts`); the other layouts differ in arithmetic only.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from pp_core.app.launch.decide import plan_spec, written_spec
from pp_core.app.plan.pipeline_factor import measure_pipeline_factor
from pp_core.app.plan.timed_layouts import MAX_WORLD, calibrated, time_layouts, timed_degrees
from pp_core.app.factories import build_model
from pp_core.app.machine import MachineShare
from pp_core.app.spec import Spec
from pp_core.errors import ConfigError, PipelineError
from pp_core.measure.collectives import measure_collectives
from pp_core.measure.layout_costs import (expert_layers, layout_profile, unit_experts,
                                          with_gradient_sync)
from pp_core.measure.layouts import DroppedLayout, ModelShape, enumerate_layouts, summary
from pp_core.measure.link import measure_local_link
from pp_core.measure.plan_auto import AutoPlan, concrete_config, default_microbatch_sizes
from pp_core.parallel.dims import ParallelDims
from pp_core.parallel.tensor_parallel import head_counts
from pp_core.planning.choose import choose_plan
from pp_core.planning.report import ac_letters, describe
from pp_core.planning.sizes import format_bytes
from pp_core.planning.units import model_units
from pp_core.plugin_manager import default_plugins, plugins_or_default

__all__ = ["WorldPlan", "LayoutPlan", "plan_world", "plan_layout", "layout_spec", "model_shape",
           "meta_model", "format_world"]

Say = Callable[[str], None]
logger = logging.getLogger(__name__)


@dataclass
class LayoutPlan:
    """One admitted layout: its spec (degrees, per-replica batch) and its AutoPlan."""

    dims: ParallelDims
    spec: Spec
    plan: Any  # pp_core.measure.plan_auto.AutoPlan

    @property
    def best(self):
        return self.plan.ranking.kept[0]


@dataclass
class WorldPlan:
    """Every layout of ``world`` processes: ``layouts`` ranked (best first), ``dropped`` with
    the reason (a degree that does not divide, memory)."""

    world: int
    layouts: list[LayoutPlan]
    dropped: list[DroppedLayout]
    memory_cap: int | None
    profile_s: float
    planning_s: float
    collectives: Any = None  # pp_core.planning.collectives.Collectives
    link: Any = None
    kept: list = field(default_factory=list)  # every plan that fits, fastest first
    profiles: dict = field(default_factory=dict)  # tp -> {microbatch size: ModelProfile}
    experts: list = field(default_factory=list)  # per unit (layout_costs.unit_experts)
    pipeline_factor: float = 1.0  # the profiled times were scaled by it (pipeline_factor)
    timed: dict = field(default_factory=dict)  # (tp, ep) -> TimedLayout (timed_layouts)

    @property
    def chosen_layout(self) -> LayoutPlan:
        if not self.layouts:
            raise ConfigError(f"--world {self.world}: no layout of {self.world} processes runs "
                              f"this model{summary(self.dropped)}; use another --world")
        return self.layouts[0]

    @property
    def chosen(self):
        return self.chosen_layout.best

    @property
    def plan(self):
        """The chosen layout's AutoPlan (what ``-o`` writes)."""
        return self.chosen_layout.plan

    def to_dict(self) -> dict[str, Any]:
        best = self.chosen.predicted_step_s
        return {
            "world_size": self.world, "chosen": self.chosen.to_dict(),
            "profile_s": self.profile_s, "pipeline_factor": self.pipeline_factor,
            "timed_layouts": [t.to_dict() for _, t in sorted(self.timed.items())],
            "link": None if self.link is None else self.link.to_dict(),
            "collectives": None if self.collectives is None else self.collectives.to_dict(),
            "layouts": [{**lp.dims.to_keys(), "predicted_step_s": lp.best.predicted_step_s,
                         "slower_than_chosen": lp.best.predicted_step_s / best - 1,
                         "plans_kept": len(lp.plan.ranking.kept)} for lp in self.layouts],
            "ranking": {"world_size": self.world, "memory_cap": self.memory_cap,
                        "planning_s": self.planning_s,
                        "kept": [c.to_dict() for c in self.kept],
                        "dropped": [d.to_dict() for d in self.dropped]}}


def meta_model(spec: Spec, plugins=None):
    """The spec's model on the meta device (shapes, no memory)."""
    with torch.device("meta"):
        return build_model(spec, plugins)


def model_shape(spec: Spec, model, plugins=None) -> ModelShape:
    """The model's units, heads and experts and the global batch."""

    heads = math.gcd(*(value for value, _ in head_counts(model).values()))  # tp divides each
    experts = {layer.num_experts for layer in expert_layers(model)}
    no_plan = ""
    if plugins_or_default(plugins).tensor_parallel_plan(model, False) is None:
        no_plan = f"no plugin provides a tensor-parallel plan for the model {type(model).__name__}"
    return ModelShape(len(model_units(model, plugins)), heads,
                      min(experts) if experts else 0, spec.global_batch_size, no_plan)


def layout_spec(spec: Spec, dims: ParallelDims) -> Spec:
    """``spec`` at the degrees ``dims``, with the same global batch (``pp_batch_size`` is a
    replica's share of it)."""
    batch = spec.global_batch_size // dims.dp
    placed = spec.with_("distributed", **dims.to_keys(), dp_size=dims.dp, world_size=None,
                        layout="fixed")
    return placed.with_("pipeline", pp_batch_size=batch, pp_microbatch_size=1)


def plan_world(spec: Spec, world: int, *, memory_cap=None, measure_link: bool = True,
               fixed: Mapping[str, int] | None = None, say: Say | None = None) -> WorldPlan:
    """Rank every layout of ``world`` processes the model admits (module docstring)."""


    model = meta_model(spec)
    admitted, dropped = enumerate_layouts(world, model_shape(spec, model), fixed)
    if not admitted:  # say so before measuring anything
        WorldPlan(world, [], dropped, memory_cap, 0.0, 0.0).chosen_layout
    started = time.perf_counter()
    base = MachineShare.of(spec)
    if say is not None and measure_link:
        say(f"plan: {len(admitted)} layouts of {world} processes admitted; timing the link and "
            f"the collectives")
    link = measure_local_link(base.backend, base.device) if measure_link and \
        any(d.pp > 1 for d in admitted) else None
    largest = max([d.dp for d in admitted] + [1])
    collectives = measure_collectives(largest, base.backend, base.device) if measure_link \
        else None
    profiles = {}  # tp degree -> {microbatch size: ModelProfile}
    chunks = (1,)  # the pp_seq_chunks values planned (the profiling says)
    for tp in sorted({d.tp for d in admitted}):
        layouts = [d for d in admitted if d.tp == tp]
        sizes = sorted({size for d in layouts for size in default_microbatch_sizes(
            spec.global_batch_size // d.dp, d.pp)})
        first = ParallelDims(layouts[0].pp, tp=tp)
        if say is not None:
            say(f"plan: profiling at tp {tp}, microbatch sizes {sizes}")
        # measured with the threads a rank of this world gets (one on a small machine)
        rank = MachineShare.of(layout_spec(spec, layouts[0]))
        measured = plan_spec(layout_spec(spec, first), rank, measure_link=False, link=link,
                             microbatch_sizes=sizes)
        profiles[tp], chunks = measured.profiles, measured.seq_chunks
    factor = 1.0
    if measure_link and base.device == "cpu" and 1 in profiles:
        if say is not None:
            say("plan: running the model as a pipeline to measure what its units cost there")
        try:
            factor = measure_pipeline_factor(spec, profiles[1], world, base.backend)
        except PipelineError as exc:  # the profile alone still ranks the layouts
            logger.warning("plan: the model's units were not measured in a running pipeline, "
                           "their profiled times are used as they are: %s", exc)
        profiles[1] = {size: p.scaled(factor) for size, p in profiles[1].items()}
    some = next(iter(next(iter(profiles.values())).values())) if profiles else None
    experts = [] if some is None else unit_experts(model, [u.fqns for u in some.units])
    profile_s = time.perf_counter() - started
    started = time.perf_counter()
    planned = []
    for number, dims in enumerate(admitted, 1):
        if say is not None:
            say(f"plan: planning layout {number}/{len(admitted)}: {dims.describe()}")
        outcome = plan_layout(spec, dims, world, profiles[dims.tp], memory_cap, link,
                               collectives, experts, chunks)
        (planned if isinstance(outcome, LayoutPlan) else dropped).append(outcome)
    planning_s = time.perf_counter() - started
    timed = {}
    if measure_link and base.device == "cpu" and world <= MAX_WORLD:
        started = time.perf_counter()
        timed = _timed(planned, world, base.backend, say)
        profile_s += time.perf_counter() - started
    for lp in planned:
        if (lp.dims.tp, lp.dims.ep) in timed:  # a uniform factor: each layout's order stays
            calibrated(lp.plan.ranking, timed[lp.dims.tp, lp.dims.ep].factor)
    planned.sort(key=lambda lp: (lp.best.predicted_step_s, lp.best.peak_bytes))
    kept = sorted((c for lp in planned for c in lp.plan.ranking.kept),
                  key=lambda c: (c.predicted_step_s, c.peak_bytes))
    return WorldPlan(world, planned, dropped, memory_cap, profile_s, planning_s, collectives,
                     link, kept, profiles, experts, factor, timed)


def _timed(planned: list[LayoutPlan], world: int, backend: str, say) -> dict:
    """One planned layout per tp / ep degree pair, run
    (:mod:`pp_core.app.plan.timed_layouts`); none where a run failed."""
    by_dims = {lp.dims: lp for lp in planned}
    runnable = {key: by_dims[dims]
                for key, dims in timed_degrees(lp.dims for lp in planned).items()}
    if runnable and say is not None:
        say(f"plan: running {', '.join(lp.dims.describe() for lp in runnable.values())} a few "
            f"steps each to time every tp / ep degree pair")
    try:
        return time_layouts(runnable, world, backend, lambda lp: written_spec(lp.spec, lp.plan))
    except PipelineError as exc:  # the arithmetic alone still ranks the layouts
        logger.warning("plan: no layout was timed by a run, the predictions are the "
                       "arithmetic's alone: %s", exc)
        return {}


def plan_layout(spec: Spec, dims: ParallelDims, world: int, profiles, memory_cap, link,
                 collectives, experts, seq_chunks=(1,)):
    """The per-layout search on the layout's profile: a LayoutPlan, or a DroppedLayout
    saying why nothing of it runs (memory, or no schedule at its sizes). ``seq_chunks``: the
    ``pp_seq_chunks`` values to plan (the profiling's)."""

    placed = layout_spec(spec, dims)
    config = placed.pipeline
    ac = spec.train.activation_checkpointing
    layout = MachineShare.of(placed)
    adjusted = {size: layout_profile(profile, dims, world, layout, collectives, experts)
                for size, profile in profiles.items() if config.pp_batch_size % size == 0}
    if not adjusted:
        return DroppedLayout(dims, f"no profiled microbatch size divides its pp_batch_size "
                                   f"{config.pp_batch_size}")
    ranking = choose_plan(adjusted, dims.pp, config.pp_batch_size,
                          default_plugins().schedules, memory_cap,
                          recv_buffer_pool=True if config.pp_recv_buffer_pool else None,
                          pool_slack=config.pp_recv_buffer_pool_slack,
                          activation_checkpointing=ac["mode"], every=ac["every"],
                          degrees=dims.to_keys(), seq_chunks=seq_chunks)
    with_gradient_sync(ranking, dims, collectives)
    try:
        chosen = ranking.chosen
    except ConfigError as exc:
        return DroppedLayout(dims, f"memory: {exc}" if memory_cap is not None and any(
            c.peak_bytes is not None for c in ranking.dropped) else str(exc))
    return LayoutPlan(dims, placed, AutoPlan(concrete_config(config, chosen), ranking, 0.0,
                                             link, adjusted))



def format_world(found: WorldPlan, top: int = 8) -> str:
    """The layouts ranked, one row each with its best plan; those dropped, and why."""

    cap = "no memory cap" if found.memory_cap is None else \
        f"memory cap {format_bytes(found.memory_cap)} per rank"
    timed = "".join(f"; {t.dims.describe()} ran {t.factor:.2f}x its arithmetic"
                    for _, t in sorted(found.timed.items()))
    lines = [f"world {found.world}: {len(found.layouts)} layouts ranked, {len(found.dropped)} "
             f"dropped ({cap}); measured in {found.profile_s:.1f} s (units cost "
             f"{found.pipeline_factor:.2f}x their profile in a running pipeline{timed}), "
             f"planned in {found.planning_s:.2f} s",
             "  #   pp  dp_r dp_s  tp  ep  schedule            v  mbs    M  step (ms) bubble  "
             "vs best  AC       peak per rank"]
    best = found.layouts[0].best.predicted_step_s if found.layouts else 0.0
    for index, lp in enumerate(found.layouts[:top]):
        c, d, o = lp.best, lp.dims, lp.best.option
        peaks = " ".join(format_bytes(m.total(c.pool)).replace(" ", "") for m in c.memory)
        lines.append(f"{index + 1:>3}  {d.pp:>3} {d.dp_replicate:>5} {d.dp_shard:>4} {d.tp:>3} "
                     f"{d.ep:>3}  {o.schedule:<18} {o.stages_per_rank:>2} {o.microbatch_size:>4} "
                     f"{o.num_microbatches:>4} {c.predicted_step_s * 1e3:>10.1f} "
                     f"{100 * c.bubble_ratio:>5.0f}% {c.predicted_step_s / best:>7.2f}x  "
                     f"{ac_letters(c):<8} {peaks}")
    if len(found.layouts) > top:
        lines.append(f"     ... {len(found.layouts) - top} more layouts (predicted slower)")
    if found.layouts:
        lp = found.chosen_layout
        lines.append(f"chosen: {lp.dims.describe()}" +
                     (f" (dp_shard {lp.dims.dp_shard})" if lp.dims.dp_shard > 1 else "") +
                     f", {describe(lp.best)}: predicted step "
                     f"{lp.best.predicted_step_s * 1e3:.1f} ms, peak "
                     f"{format_bytes(lp.best.peak_bytes)} per rank")
        if lp.plan.processors is not None:  # fewer cores than ranks: predicted as shared
            lines.append(f"cores: its ranks share {lp.plan.processors:g} processors' worth of "
                         f"this machine's cores (predicted with the processor-sharing replay)")
    for dropped in found.dropped[:top]:
        d = dropped.dims
        lines.append(f"dropped pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard "
                     f"{d.dp_shard} x tp {d.tp} x ep {d.ep}: {dropped.reason}")
    if len(found.dropped) > top:
        lines.append(f"     ... {len(found.dropped) - top} more layouts dropped (--json lists "
                     f"each with its reason)")
    lines.append("AC: activation checkpointing per stage (f full, s selective, - none); "
                 "vs best: predicted step over the chosen layout's")
    return "\n".join(lines)
