"""``pipeline.pp_schedule: auto`` for YAML pipelines: plan once, in the launching process.

Every rank must run the same plan, and a plan made from timings differs from one process to the
next; so the decision is made once, here, before any rank starts: the model is built for real on
the run's device (same seed, same arguments as the ranks build it), one step's batch is taken
from the dataset, the model is profiled, the link between two local processes is measured, and
:func:`pp_core.plan_auto` chooses. The ranks then receive a *concrete* pipeline
section (schedule, microbatch size, module FQNs per stage, receive-buffer pool): identical inputs
on every rank, nothing decided there. ``pp-core plan`` runs the same steps and prints the ranking.
"""

from __future__ import annotations

from typing import Callable

from pp_core.errors import ConfigError
from pp_core.app.rendezvous import started_by_torchrun
from pp_core.app.spec import Spec

__all__ = ["is_auto", "as_auto", "plan_spec", "resolved_spec", "resolve_for_launch", "PLANNED_KEYS"]

PLANNED_KEYS = ("pp_schedule", "pp_schedule_csv", "pp_microbatch_size", "layers_per_stage",
                "round_virtual_stages_to_pp_multiple", "module_fqns_per_model_part",
                "pp_recv_buffer_pool")
"""The ``pipeline`` keys a plan fixes."""


def is_auto(spec: Spec) -> bool:
    schedule = spec.pipeline["pp_schedule"]
    return isinstance(schedule, str) and schedule.lower() == "auto"


def plan_spec(spec: Spec, memory_cap=None, plugins=None, measure_link: bool = True,
              say: Callable[[str], None] | None = None):
    """Profile the spec's model on its device and choose: a
    :class:`pp_core.runtime.plan_auto.AutoPlan`."""
    from pp_core.app.balanced_launch import as_a_rank, spec_model_and_batch
    from pp_core.devices import choose
    from pp_core.runtime.plan_auto import plan_auto

    pp_size = spec.distributed["pp_size"]
    model, inputs, target, device = spec_model_and_batch(spec, plugins)  # as a rank builds them
    link = None
    if measure_link and pp_size > 1:
        from pp_core.runtime.link import measure_local_link

        if say is not None:
            say("auto: measuring the link between two local ranks")
        choice = choose(spec)
        link = measure_local_link(choice.backend, choice.device)
    if say is not None:
        say(f"auto: profiling {type(model).__name__} on {device}")
    with as_a_rank(spec, device):
        return plan_auto(model, spec.pipeline_config(), inputs, target, pp_size,
                         device=device, memory_cap=memory_cap, plugins=plugins, link=link,
                         processors=_processors(spec, device))


def _processors(spec: Spec, device) -> float | None:
    """What the spec's CPU ranks share of this machine's cores (pp x dp ranks, each with its
    thread count); ``None`` on GPUs, one each."""
    from pp_core.app.balanced_launch import rank_threads
    from pp_core.devices import cpu_cores, local_ranks, shared_processors

    if device.type != "cpu":
        return None
    return shared_processors(cpu_cores(), rank_threads(spec), local_ranks(spec.distributed),
                             spec.distributed["pp_size"])


def as_auto(spec: Spec) -> Spec:
    """The spec with ``pp_schedule: auto`` and nothing fixing the schedule or the split, for
    ``pp-core plan`` on a file that names a schedule (the plan does not use it, so a schedule
    that could not run at this ``pp_size`` must not stop the planning)."""
    if is_auto(spec):
        return spec
    values = spec.to_dict()
    values["pipeline"].update(pp_schedule="auto", pp_schedule_csv=None, layers_per_stage=None,
                              module_fqns_per_model_part=None,
                              round_virtual_stages_to_pp_multiple=None)
    return Spec(values, spec.source)


def resolved_spec(spec: Spec, plan) -> Spec:
    """The spec every rank runs: the plan's concrete pipeline keys, and ``plan`` (what was
    predicted, for the run summary)."""
    values = spec.to_dict()
    chosen = plan.config.to_dict()
    for key in PLANNED_KEYS:
        values["pipeline"][key] = chosen[key]
    best = plan.chosen
    values["plan"] = {"schedule": best.option.schedule,
                      "stages_per_rank": best.option.stages_per_rank,
                      "microbatch_size": best.option.microbatch_size,
                      "predicted_step_s": best.predicted_step_s,
                      "predicted_peak_bytes": [m.total(best.pool) for m in best.memory]}
    return Spec(values, spec.source)


def resolve_for_launch(spec: Spec, announce: Callable[[str], None] | None = None,
                       memory_cap: int | None = None) -> Spec:
    """What the launcher runs when the file says ``auto``; a rank started by torchrun cannot
    plan alone (its peers would time the model differently), so that case is refused."""
    from pp_core.planning.report import describe

    if started_by_torchrun():
        raise ConfigError("pipeline.pp_schedule: auto is planned by the launching process, and "
                          "under torchrun every process is a rank; run 'pp-core plan FILE' and "
                          "put the chosen schedule, pp_microbatch_size and "
                          "module_fqns_per_model_part in the file, or start with 'pp-core run'")
    plan = plan_spec(spec, memory_cap=memory_cap, say=announce)
    if announce is not None:
        announce(f"auto: chose {describe(plan.chosen)} (predicted step "
                 f"{plan.predicted_step_s * 1e3:.1f} ms; profiled in {plan.profile_s:.1f} s, "
                 f"planned in {plan.ranking.planning_s:.2f} s)")
    return resolved_spec(spec, plan)
