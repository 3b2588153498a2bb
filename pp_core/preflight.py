"""Checks of a pipeline spec that need the installed plugins: run before any process starts.

:func:`preflight` resolves the model and dataset names, checks their ``args`` against the
factories' signatures, builds the model on the meta device (no memory, no init) to plan the
split with the splitter plugins, and builds and validates the schedule for ``pp_size`` ranks.
Every mistake becomes a line of one :class:`~pp_core.spec.SpecError` that names the YAML key.

:func:`model_factory`, :func:`dataset_factory` and :func:`dataset_args` are shared with the
training processes so that what ``pp-core validate`` checks is exactly what ``pp-core run`` uses.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from pp_core.devices import choose as choose_device
from pp_core.devices import resolve_device
from pp_core.errors import ConfigError, PPCoreError, quoted
from pp_core.spec import Spec, SpecError

__all__ = ["Preflight", "preflight", "model_factory", "dataset_factory", "dataset_args",
           "schedule_def_for", "resolve_device"]


@dataclass
class Preflight:
    """What validation found: the split plan and schedule (``None`` where they could not be made)."""

    plan: Any = None
    schedule: Any = None
    notes: list[str] = field(default_factory=list)


def _plugins(plugins):
    if plugins is not None:
        return plugins
    from pp_core.plugins import default_plugins

    return default_plugins()


def model_factory(spec: Spec, plugins=None) -> Callable:
    """The callable that builds the model: a registered name, or ``model.target`` (imports code)."""
    if spec.model["target"] is not None:
        from pp_core.config import resolve_callable

        target = resolve_callable(spec.model["target"], "model.target")
        if not (inspect.isclass(target) or inspect.isfunction(target)):
            raise ConfigError(f"model.target={quoted(spec.model['target'])} names a "
                              f"{type(target).__name__}, not a class or a Python function; "
                              f"validate and run call it with model.args, so name your model's "
                              f"class or factory function")
        return target
    return _plugins(plugins).models.get(spec.model["name"])


def dataset_factory(spec: Spec, plugins=None) -> Callable:
    return _plugins(plugins).datasets.get(spec.data["name"])


def _accepts(factory: Callable, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def dataset_args(spec: Spec, factory: Callable, evaluation: bool = False) -> dict:
    """``data.args`` (with ``data.eval_args`` over them for evaluation), plus the global batch size.

    Every dataset yields whole-step batches of ``pp_batch_size * dp_size`` samples; a factory
    that takes ``batch_size`` gets it filled in when the YAML leaves it out.
    """
    args = dict(spec.data["args"])
    if evaluation:
        args.update(spec.data["eval_args"])
    if "batch_size" not in args and _accepts(factory, "batch_size"):
        args["batch_size"] = spec.global_batch_size
    return args


def schedule_def_for(spec: Spec, plugins=None):
    """The schedule's :class:`ScheduleDef` (``None`` for a CSV schedule)."""
    if spec.pipeline["pp_schedule_csv"]:
        return None
    from pp_core.schedule.build import resolve_schedule_def

    return resolve_schedule_def(spec.pipeline["pp_schedule"], _plugins(plugins))[1]


def _splitter(spec: Spec):
    """``model.splitter`` as the meta-device plan uses it: ``balanced`` cuts where measured time
    says, at launch (:mod:`pp_core.balanced_launch`); its stage count is its base splitter's."""
    name = spec.model.get("splitter")
    return None if name is not None and name.lower() == "balanced" else name


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
    the resume path, the output paths: :mod:`pp_core.preflight_build`), so that what would fail
    after the ranks start is refused before.
    """
    plugins = _plugins(plugins)
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
        from pp_core.preflight_build import check_local_ranks, check_outputs

        check_outputs(spec, problems, result.notes)
        check_local_ranks(spec, problems)
    if problems:
        raise SpecError(problems, spec.source)
    if build:
        model = _plan_and_schedule(spec, plugins, model_fn, result, problems)
        if run_checks and not problems:
            from pp_core.preflight_build import check_build

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
    from pp_core.parallel import find_blocks

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
    from pp_core.errors import ScheduleError
    from pp_core.schedule.build import build_schedule

    config = spec.pipeline_config()
    num_ranks = spec.distributed["pp_size"]
    auto = str(spec.pipeline["pp_schedule"]).lower() == "auto"
    try:
        sdef = None if auto else schedule_def_for(spec, plugins)
    except ScheduleError as exc:
        problems.append(f"pipeline.pp_schedule: {exc}")
        return None
    stages_per_rank = sdef.stages_per_rank if sdef is not None else None
    if sdef is None and not auto:  # a CSV fixes its stage count: derive stages_per_rank
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
    from pp_core.preflight_build import build_meta_model

    model = build_meta_model(spec, model_fn, problems, result.notes)
    if problems:
        return None
    if model is not None:
        _check_blocks(spec, model, problems)
    if auto:  # the launcher profiles the model and chooses; 'pp-core plan' shows the choice
        result.notes.append("pipeline.pp_schedule: auto: the schedule, microbatch size and split "
                            "are chosen when the run starts ('pp-core plan FILE' shows them)")
        return model
    if model is not None:
        from pp_core.runtime.split import plan_split

        try:
            result.plan = plan_split(
                model, config, num_ranks, stages_per_rank, plugins, _splitter(spec),
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
