"""Decide once, in the launching process, the pipeline every rank runs: :func:`decide`.

Every rank must run the same plan, and a plan made from timings differs from one process to the
next; so what is measured is measured here, before any rank starts (:mod:`pp_core.app.launch.measured`),
and the ranks receive a *concrete* pipeline section - identical inputs everywhere, nothing
decided there. Three cases, one entry point:

- ``pipeline.pp_schedule: auto``: profile the model, measure the link between two local
  processes, and let :func:`pp_core.plan_auto` choose schedule, microbatch size, split and pool;
- ``model.splitter: balanced``: profile once and write the cost-balanced cut into
  ``pipeline.module_fqns_per_model_part``;
- anything else: the spec as written.

A rank started by torchrun has no launching process to decide for it, so both measured cases are
refused there with the way out. ``pp-core plan`` runs the same steps and prints the ranking.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from pp_core.app.factories import build_model
from pp_core.app.machine import MachineShare
from pp_core.app.rendezvous import started_by_torchrun
from pp_core.app.spec import Spec, auto_expert_parallel_refusal
from pp_core.config import is_auto
from pp_core.errors import ConfigError
from pp_core.planning.plan import plan_pipeline

__all__ = ["decide", "is_balanced", "as_auto", "plan_spec", "resolved_spec", "balanced_spec",
           "written_spec", "PLANNED_KEYS"]

PLANNED_KEYS = ("pp_schedule", "pp_schedule_csv", "pp_microbatch_size", "layers_per_stage",
                "round_virtual_stages_to_pp_multiple", "module_fqns_per_model_part",
                "pp_recv_buffer_pool", "pp_seq_chunks")
"""The ``pipeline`` keys a plan fixes."""

Say = Callable[[str], None]


def is_balanced(spec: Spec) -> bool:
    """``model.splitter: balanced`` (the cut is measured at launch)."""
    name = spec.model.splitter
    return name is not None and name.lower() == "balanced"


def decide(spec: Spec, layout: MachineShare, *, announce: Say | None = None,
           memory_cap: int | None = None) -> Spec:
    """The spec every rank runs: ``auto`` planned, a ``balanced`` cut measured, or ``spec``."""
    planned = (spec.prediction or {}).get("layouts")  # elastic: planned by elastic_layouts
    if spec.distributed.layout == "auto" and not planned:  # the degrees decide the processes
        raise ConfigError(
            f"distributed.layout: auto is chosen by 'pp-core plan {spec.source} -o chosen.yaml' "
            f"(it ranks the layouts of {spec.distributed.world_size} processes); run the file it "
            f"writes, or write the degrees and drop layout: auto")
    auto = is_auto(spec.pipeline.pp_schedule)
    if started_by_torchrun():  # every process is a rank: nobody can measure for all of them
        if auto:
            raise ConfigError(
                "pipeline.pp_schedule: auto is planned by the launching process, and under "
                "torchrun every process is a rank; run 'pp-core plan FILE' and put the chosen "
                "schedule, pp_microbatch_size and module_fqns_per_model_part in the file, or "
                "start with 'pp-core run'")
        if is_balanced(spec) and spec.pipeline.module_fqns_per_model_part is None:
            raise ConfigError(
                "model.splitter: balanced profiles once in the launching process, which "
                "torchrun does not have; start it with `pp-core run`, or put the cut into "
                "pipeline.module_fqns_per_model_part")
        return spec
    if auto:
        return _planned(spec, layout, announce, memory_cap)
    if is_balanced(spec):
        return balanced_spec(spec, say=announce, layout=layout)
    return spec


def _planned(spec: Spec, layout: MachineShare, announce: Say | None, memory_cap) -> Spec:
    from pp_core.planning.report import describe  # lazy: the planner, only when planning

    plan = plan_spec(spec, layout, memory_cap=memory_cap, say=announce)
    if announce is not None:
        announce(f"auto: chose {describe(plan.chosen)} (predicted step "
                 f"{plan.predicted_step_s * 1e3:.1f} ms; profiled in {plan.profile_s:.1f} s, "
                 f"planned in {plan.ranking.planning_s:.2f} s)")
    return resolved_spec(spec, plan)


def plan_spec(spec: Spec, layout: MachineShare | None = None, memory_cap=None, plugins=None,
              measure_link: bool = True, say: Say | None = None, link=None,
              microbatch_sizes=None):
    """Profile the spec's model as a rank runs it and choose: a
    :class:`pp_core.measure.plan_auto.AutoPlan`. ``link``: one measured already (the layout
    search measures it once); ``microbatch_sizes``: those to profile (default: as
    :func:`~pp_core.measure.plan_auto.default_microbatch_sizes`)."""
    from pp_core.app.launch.measured import (  # lazy: torch, only when measuring
        as_a_rank, model_and_batch, plan_sharded)
    from pp_core.measure.link import measure_local_link
    from pp_core.measure.plan_auto import plan_auto

    layout = MachineShare.of(spec) if layout is None else layout
    dims = spec.dims
    if dims.ep > 1:  # the spec refuses it too; 'pp-core plan' makes any file auto
        raise ConfigError(auto_expert_parallel_refusal(dims.ep))
    pp_size, tp = dims.pp, dims.tp
    ac = spec.train.activation_checkpointing
    planning = {"activation_checkpointing": ac["mode"], "every": ac["every"],
                "degrees": spec.dims.to_keys(), "microbatch_sizes": microbatch_sizes}
    if link is None and measure_link and pp_size > 1:
        if say is not None:
            say("auto: measuring the link between two local ranks")
        link = measure_local_link(layout.backend, layout.device)
    if tp > 1:  # a stage is tp processes: profiled by as many, collectives and all
        if plugins is not None:
            raise ConfigError("plan_spec: plugins= cannot reach the processes that profile a "
                              "tensor-parallel stage (distributed.tp_size > 1); install the "
                              "plugins (entry points) instead")
        if say is not None:
            say(f"auto: profiling the model sharded {tp} ways by {tp} local processes")
        return plan_sharded(spec, layout, memory_cap=memory_cap, link=link,
                            processors=layout.processors, **planning)
    model, inputs, target, device = model_and_batch(spec, layout, plugins)
    if say is not None:
        say(f"auto: profiling {type(model).__name__} on {device}")
    with as_a_rank(layout, device):
        return plan_auto(model, spec.pipeline, inputs, target, pp_size,
                         device=device, memory_cap=memory_cap, plugins=plugins, link=link,
                         processors=layout.processors, **planning)  # None off the CPU


def as_auto(spec: Spec) -> Spec:
    """The spec with ``pp_schedule: auto`` and nothing fixing the schedule or the split, for
    ``pp-core plan`` on a file that names a schedule (the plan does not use it, so a schedule
    that could not run at this ``pp_size`` must not stop the planning)."""
    if is_auto(spec.pipeline.pp_schedule):
        return spec
    return spec.with_("pipeline", pp_schedule="auto", pp_schedule_csv=None,
                      layers_per_stage=None, module_fqns_per_model_part=None,
                      round_virtual_stages_to_pp_multiple=None)


def resolved_spec(spec: Spec, plan) -> Spec:
    """The spec every rank runs: the plan's concrete pipeline keys, and ``prediction`` (what
    was chosen and predicted, for the run summary)."""
    chosen = plan.config.to_dict()
    best = plan.chosen
    predicted = {"schedule": best.option.schedule,
                 "stages_per_rank": best.option.stages_per_rank,
                 "microbatch_size": best.option.microbatch_size,
                 "seq_chunks": best.option.seq_chunks,
                 "predicted_step_s": best.predicted_step_s,
                 "predicted_peak_bytes": [m.total(best.pool) for m in best.memory],
                 "activation_checkpointing": best.stage_modes()}
    planned = spec.with_("pipeline", **{key: chosen[key] for key in PLANNED_KEYS})
    ac = spec.train.activation_checkpointing
    if ac["mode"] == "auto":  # the planner's choice, one mode per stage; else as written
        planned = planned.with_("train", activation_checkpointing={
            **ac, "mode": list(best.stage_modes())})
    return replace(planned, prediction=predicted)


def written_spec(spec: Spec, plan) -> dict:
    """The chosen layout as a plain YAML pipeline (``pp-core plan -o FILE``): the file with
    the plan's concrete keys, which ``pp-core run`` runs as it stands (no ``auto`` left)."""
    values = resolved_spec(spec, plan).to_dict()
    values.pop("prediction", None)
    values["distributed"].update(plan.chosen.degrees)
    values["distributed"].pop("dp_size", None)  # derived from dp_replicate x dp_shard
    values["distributed"].update(world_size=None, layout="fixed")  # the degrees are written
    return values


def balanced_spec(spec: Spec, plugins=None, say: Say | None = None,
                  layout: MachineShare | None = None) -> Spec:
    """The spec every rank gets: ``module_fqns_per_model_part`` cut by measured time.

    The stage count is the one the run plans (the schedule's stages per rank, or
    ``layers_per_stage``); ``say`` gets one line per stage with its measured seconds.
    """
    from pp_core.app.launch.measured import profile_spec  # lazy: torch, only when measuring
    from pp_core.planning.balance import balance, stage_fqns, unit_costs

    if spec.pipeline.module_fqns_per_model_part is not None:
        raise ConfigError("model.splitter: balanced cuts the model itself, but pipeline."
                          "module_fqns_per_model_part names the stages too; remove one of them")
    if spec.distributed.max_nodes > 1:
        raise ConfigError("model.splitter: balanced profiles on the launching machine, and each "
                          "of several nodes would measure its own cut; profile once (pp_core."
                          "app.launch.measured.profile_spec) and put the cut into pipeline."
                          "module_fqns_per_model_part")
    num_stages = _num_stages(spec, plugins)
    size = spec.pipeline.pp_microbatch_size
    profile = profile_spec(spec, [size], plugins, layout=layout)[size]
    costs = unit_costs(profile)
    counts = balance(costs, num_stages)
    stages = stage_fqns([unit.fqns for unit in profile.units], counts)
    start = 0
    for index, count in enumerate(counts):
        if say is not None:
            say(f"balanced split: stage {index}: {count} unit(s), "
                f"{sum(costs[start:start + count]) * 1e3:.2f} ms forward+backward per "
                f"microbatch ({stages[index][0]} .. {stages[index][-1]})")
        start += count
    return spec.with_("pipeline", module_fqns_per_model_part=stages, layers_per_stage=None,
                      round_virtual_stages_to_pp_multiple=None)


def _num_stages(spec: Spec, plugins) -> int:
    """The stage count the run will have (schedule, ``layers_per_stage``), planned on the meta
    device with the splitter that gives the model its units."""
    import torch  # lazy: torch, only when something is measured

    with torch.device("meta"):
        model = build_model(spec, plugins)
    return plan_pipeline(model, spec.pipeline, spec.distributed.pp_size,
                         plugins=plugins).split.num_stages
