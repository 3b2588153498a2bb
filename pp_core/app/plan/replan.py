"""``distributed.layout: auto`` on an elastic run: the whole layout planned for every world the
run may be given, from one measurement.

An elastic run (``nnodes: "MIN:MAX"``) may go on at any of ``MIN..MAX`` nodes. At launch, the
layouts of the whole world (``distributed.world_size``) are measured and ranked once
(:func:`~pp_core.app.plan.plan_world.plan_world`); each smaller world the run may be given is
then planned from those same measurements (:func:`replan`: the profiles, the link, the
collectives and the calibration of the whole world's search; nothing measured again), so a rank
that the agent starts at a smaller world takes that world's best layout - pp, dp, tp, the
schedule, the split and the microbatch size - instead of keeping the full world's pp x tp.
The table (:func:`plan_worlds`) goes to every rank with the spec
(:mod:`pp_core.app.elastic_layouts` picks from it, and keeps it in ``checkpoint.dir`` for the
other nodes and later launches).
"""

from __future__ import annotations

from typing import Callable, Mapping

from pp_core.app.launch.decide import PLANNED_KEYS, resolved_spec
from pp_core.app.plan.plan_world import (LayoutPlan, WorldPlan, meta_model, model_shape,
                                         plan_layout, plan_world)
from pp_core.app.plan.timed_layouts import calibrated
from pp_core.app.spec import Spec
from pp_core.errors import ConfigError
from pp_core.measure.layouts import DroppedLayout, enumerate_layouts, summary

__all__ = ["replan", "plan_worlds", "layout_entry"]

Say = Callable[[str], None]


def replan(found: WorldPlan, spec: Spec, world: int,
           fixed: Mapping[str, int] | None = None) -> LayoutPlan:
    """The best layout of ``world`` processes from what ``found`` (a larger world's search)
    measured: its profiles per tp degree, link, collectives and per-(tp, ep) calibration. A
    layout at a tp degree ``found`` did not profile is left out (it would need a measurement)."""
    if world == found.world:
        return found.chosen_layout
    model = meta_model(spec)
    admitted, dropped = enumerate_layouts(world, model_shape(spec, model), fixed)
    planned = []
    for dims in admitted:
        if dims.tp not in found.profiles:
            dropped.append(DroppedLayout(dims, f"tp_size {dims.tp} was not profiled at launch"))
            continue
        outcome = plan_layout(spec, dims, world, found.profiles[dims.tp], found.memory_cap,
                              found.link, found.collectives, found.experts)
        if isinstance(outcome, DroppedLayout):
            dropped.append(outcome)
            continue
        timed = found.timed.get((dims.tp, dims.ep))
        if timed is not None:  # the whole world's run of this degree pair calibrates it too
            calibrated(outcome.plan.ranking, timed.factor)
        planned.append(outcome)
    if not planned:
        raise ConfigError(f"distributed.layout: auto: no layout of {world} processes runs this "
                          f"model{summary(dropped)}; choose an nnodes MIN whose world does")
    planned.sort(key=lambda lp: (lp.best.predicted_step_s, lp.best.peak_bytes))
    return planned[0]


def layout_entry(chosen: LayoutPlan) -> dict:
    """What a rank needs of a planned layout, as plain data: the degrees, the pipeline keys the
    plan fixes (and ``pp_batch_size``: the global batch over dp), activation checkpointing and
    the prediction (with the layout, for the summary)."""
    planned = resolved_spec(chosen.spec, chosen.plan)
    pipeline = planned.pipeline.to_dict()
    return {"degrees": chosen.dims.to_keys(),
            "pipeline": {key: pipeline[key] for key in (*PLANNED_KEYS, "pp_batch_size")},
            "activation_checkpointing": planned.train.activation_checkpointing,
            "prediction": {**planned.prediction, "layout": chosen.dims.describe()}}


def plan_worlds(spec: Spec, worlds: list[int], *, memory_cap=None, measure_link: bool = True,
                fixed: Mapping[str, int] | None = None, say: Say | None = None) -> dict:
    """``{world: layout_entry}`` for each of ``worlds``: the largest measured and ranked, the
    others re-planned from its measurements (:func:`replan`)."""
    found = plan_world(spec, max(worlds), memory_cap=memory_cap, measure_link=measure_link,
                       fixed=fixed, say=say)
    table = {}
    for world in sorted(set(worlds), reverse=True):
        chosen = replan(found, spec, world, fixed)
        table[str(world)] = layout_entry(chosen)
        if say is not None:
            best = chosen.best
            say(f"auto: at {world} ranks {chosen.dims.describe()}, {best.option.schedule} "
                f"(predicted step {best.predicted_step_s * 1e3:.1f} ms)")
    return table
