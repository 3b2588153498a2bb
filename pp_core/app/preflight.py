"""Checks of a pipeline spec that need the installed plugins: run before any process starts.

:func:`preflight` resolves the model and dataset names, checks their ``args`` against the
factories' signatures, builds the model on the meta device (no memory, no init) to plan the
split with the splitter plugins, and builds and validates the schedule for ``pp_size`` ranks.
Every mistake becomes a line of one :class:`~pp_core.app.spec.SpecError` that names the YAML key.

The model and dataset factories come from :mod:`pp_core.app.factories`, as in the training
processes, so that what ``pp-core validate`` checks is exactly what ``pp-core run`` uses.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from pp_core.app.factories import dataset_factory, model_factory, plugins_or_installed
from pp_core.app.preflight_build import (
    build_meta_model, check_build, check_local_ranks, check_outputs,
)
from pp_core.app.spec import Spec, SpecError
from pp_core.devices import choose as choose_device
from pp_core.devices import resolve_device
from pp_core.errors import PPCoreError, ScheduleError
from pp_core.planning.split import plan_split
from pp_core.schedule.build import build_schedule, resolve_schedule_def

__all__ = ["Preflight", "preflight", "schedule_def_for", "resolve_device"]


@dataclass
class Preflight:
    """What validation found: the split plan and schedule (``None`` where they could not be made)."""

    plan: Any = None
    schedule: Any = None
    notes: list[str] = field(default_factory=list)


def schedule_def_for(spec: Spec, plugins=None):
    """The schedule's :class:`ScheduleDef` (``None`` for a CSV schedule)."""
    if spec.pipeline["pp_schedule_csv"]:
        return None

    return resolve_schedule_def(spec.pipeline["pp_schedule"], plugins_or_installed(plugins))[1]


def _check_args(where: str, factory: Callable, args: dict, problems: list[str]) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in names:
            guess = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"did you mean '{where}.{guess[0]}'? " if guess else ""
            problems.append(f"{where}.{key}: unknown argument of "
                            f"{getattr(factory, '__qualname__', factory)}; {hint}"
                            f"its arguments: {', '.join(names) or 'none'}")


def preflight(spec: Spec, plugins=None, *, build: bool = True,
              run_checks: bool = True) -> Preflight:
    """Check names, arguments, batch sizes, the split and the schedule; raise one SpecError.

    With ``run_checks`` it also builds what a rank builds (datasets and a batch, the optimizer,
    the resume path, the output paths: :mod:`pp_core.app.preflight_build`), so that what would fail
    after the ranks start is refused before.
    """
    plugins = plugins_or_installed(plugins)
    problems: list[str] = []
    result = Preflight()
    model_fn = data_fn = None
    key = "model.target" if spec.model["target"] is not None else "model.name"
    try:
        model_fn = model_factory(spec, plugins)
        _check_args("model.args", model_fn, spec.model["args"], problems)
    except PPCoreError as exc:
        problems.append(f"{key}: {exc}")
    try:
        data_fn = dataset_factory(spec, plugins)
        for section in ("args", "eval_args"):
            _check_args(f"data.{section}", data_fn, spec.data[section], problems)
        _check_batch(spec, problems)
    except PPCoreError as exc:
        problems.append(f"data.name: {exc}")
    if spec.pipeline["loss_fn"] is None:
        problems.append("pipeline.loss_fn: expected a loss for the last stage, found none; "
                        "e.g. loss_fn: cross_entropy, or 'module:attr'")
    try:
        choose_device(spec)
    except PPCoreError as exc:
        problems.append(str(exc))
    if run_checks:
        check_outputs(spec, problems, result.notes)
        check_local_ranks(spec, problems)
    if problems:
        raise SpecError(problems, spec.source)
    if build:
        model = _plan_and_schedule(spec, plugins, model_fn, result, problems)
        if run_checks and not problems:
            check_build(spec, model, data_fn, problems, result.notes, plugins)
    if problems:
        raise SpecError(problems, spec.source)
    return result


def _check_batch(spec: Spec, problems: list[str]) -> None:
    for section in ("args", "eval_args"):
        size = spec.data[section].get("batch_size")
        if size is not None and size != spec.global_batch_size:
            problems.append(
                f"data.{section}.batch_size: expected pipeline.pp_batch_size * "
                f"distributed.dp_size = {spec.pipeline['pp_batch_size']} * "
                f"{spec.distributed['dp_size']} = {spec.global_batch_size} (each step's global "
                f"batch), found {size}; leave it out and pp-core fills it in")


def _check_blocks(spec: Spec, model, problems: list[str]) -> None:
    """``train.activation_checkpointing`` / ``train.compile`` act per block: the model needs some."""
    from pp_core.parallel import find_blocks  # torch: only when AC or compile is asked for

    wanted = [key for key, on in (("activation_checkpointing",
                                   spec.train["activation_checkpointing"]["mode"] != "none"),
                                  ("compile", spec.train["compile"]["enabled"])) if on]
    if not wanted:
        return
    try:
        find_blocks(model)
    except PPCoreError as exc:
        problems.append(f"train.{wanted[0]}: {exc}")


def _plan_and_schedule(spec, plugins, model_fn, result: Preflight, problems: list[str]):
    """Plan the split on the meta device, then build + validate the schedule with its sizes;
    returns the meta model (``None`` where it could not be built)."""
    config = spec.pipeline_config()
    num_ranks = spec.distributed["pp_size"]
    try:
        sdef = schedule_def_for(spec, plugins)
    except ScheduleError as exc:
        problems.append(f"pipeline.pp_schedule: {exc}")
        return None
    stages_per_rank = sdef.stages_per_rank if sdef is not None else None
    if sdef is None:  # a CSV determines its stage count: derive stages_per_rank as run does
        try:
            csv_schedule = build_schedule(num_ranks=num_ranks,
                                          num_microbatches=config.num_microbatches,
                                          csv_path=spec.pipeline["pp_schedule_csv"],
                                          plugins=plugins)
        except ScheduleError as exc:
            problems.append(f"pipeline.pp_schedule_csv: {exc} (pp_size={num_ranks}, "
                            f"microbatches = pp_batch_size / pp_microbatch_size = "
                            f"{config.num_microbatches})")
            return None
        stages_per_rank = csv_schedule.num_stages // num_ranks

    model = build_meta_model(spec, model_fn, problems, result.notes)
    if problems:
        return None
    if model is not None:
        _check_blocks(spec, model, problems)

        try:
            result.plan = plan_split(
                model, config, num_ranks, stages_per_rank, plugins,
                variable_stages_per_rank=bool(sdef and sdef.variable_stages_per_rank))
            stages_per_rank = result.plan.stages_per_rank
        except PPCoreError as exc:
            problems.append(f"pipeline: cannot split the model: {exc}")
            return model
    try:
        result.schedule = build_schedule(
            spec.pipeline["pp_schedule"], num_ranks=num_ranks,
            num_microbatches=config.num_microbatches, stages_per_rank=stages_per_rank,
            csv_path=spec.pipeline["pp_schedule_csv"], plugins=plugins)
    except ScheduleError as exc:
        key = "pipeline.pp_schedule_csv" if spec.pipeline["pp_schedule_csv"] else \
            "pipeline.pp_schedule"
        problems.append(f"{key}: {exc} (pp_size={num_ranks}, microbatches = pp_batch_size / "
                        f"pp_microbatch_size = {config.num_microbatches})")
    return model
