"""Checks of a pipeline spec that need the installed plugins: run before any process starts.

:func:`preflight` resolves the model and dataset names, checks their ``args`` against the
factories' signatures, builds the model on the meta device (no memory, no init) to plan the
split with the splitter plugins, and builds and validates the schedule for ``pp_size`` ranks.
Every mistake becomes a line of one :class:`~pp_core.app.spec.SpecError` that names the YAML key.

:func:`~pp_core.planning.plan.plan_pipeline` plans here as it does on every rank, and the model
and dataset factories come from :mod:`pp_core.app.factories` as they do in a run, so what
``pp-core validate`` checks is exactly what ``pp-core run`` builds.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from pp_core.app.factories import dataset_factory, model_factory
from pp_core.app.machine import MachineShare
from pp_core.app.check.calls import check_module_calls
from pp_core.app.check.build import build_meta_model, check_build, check_local_ranks
from pp_core.app.check.fit import check_mixed_precision
from pp_core.app.check.initializers import stage_initializers
from pp_core.app.check.outputs import check_outputs
from pp_core.app.spec import Spec, SpecError
from pp_core.config import is_auto
from pp_core.errors import PPCoreError, did_you_mean
from pp_core.planning.plan import plan_pipeline, schedule_field, schedule_shape
from pp_core.plugin_manager import plugins_or_default

__all__ = ["Preflight", "preflight"]


@dataclass
class Preflight:
    """What validation found: the split plan and schedule (``None`` where they could not be made)."""

    plan: Any = None
    schedule: Any = None
    notes: list[str] = field(default_factory=list)
    trainable: Any = None  # per stage: holds a parameter that requires a gradient
    initializers: Any = None
    """Per stage, ``[(resource_key, signature, modules)]`` of the runtime initializers its part
    collects (``None`` when the split was not planned)."""


def _splitter(spec: Spec):
    """``model.splitter`` as the meta-device plan uses it: ``balanced`` cuts where measured time
    says, at launch (:mod:`pp_core.app.launch.decide`); its stage count is its base splitter's."""
    name = spec.model.splitter
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
            hint = did_you_mean(key, names, cutoff=0.5, show=lambda name: f"'{where}.{name}'",
                                after=" ")
            problems.append(f"{where}.{key}: unknown argument of "
                            f"{getattr(factory, '__qualname__', factory)}; {hint}"
                            f"its arguments: {', '.join(names) or 'none'}")


def preflight(spec: Spec, plugins=None, *, build: bool = True,
              run_checks: bool = True) -> Preflight:
    """Check names, arguments, batch sizes, the split and the schedule; raise one SpecError.

    With ``run_checks`` it also builds what a rank builds (datasets and a batch, the optimizer,
    the resume path: :mod:`pp_core.app.check.build`; the output paths:
    :mod:`pp_core.app.check.outputs`), so that what would fail
    after the ranks start is refused before.
    """
    plugins = plugins_or_default(plugins)
    problems: list[str] = []
    result = Preflight()
    model_fn = data_fn = None
    key = "model.target" if spec.model.target is not None else "model.name"
    try:
        model_fn = model_factory(spec, plugins)
        _check_args("model.args", model_fn, spec.model.args, problems)
    except PPCoreError as exc:
        problems.append(f"{key}: {exc}")
    try:
        data_fn = dataset_factory(spec, plugins)
        for section in ("args", "eval_args"):
            _check_args(f"data.{section}", data_fn, getattr(spec.data, section), problems)
        _check_batch(spec, problems)
    except PPCoreError as exc:
        problems.append(f"data.name: {exc}")
    if spec.pipeline.loss_fn is None:
        problems.append("pipeline.loss_fn: expected a loss for the last stage, found none; "
                        "e.g. loss_fn: cross_entropy, or 'module:attr'")
    try:
        MachineShare.of(spec)  # a device this machine cannot give
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
            batch = check_build(spec, model, data_fn, problems, result.notes, plugins)
            if not problems:
                check_module_calls(spec, model, result.plan, batch, problems)
    if problems:
        raise SpecError(problems, spec.source)
    return result


def _check_batch(spec: Spec, problems: list[str]) -> None:
    for section in ("args", "eval_args"):
        size = getattr(spec.data, section).get("batch_size")
        if size is not None and size != spec.global_batch_size:
            problems.append(
                f"data.{section}.batch_size: expected pipeline.pp_batch_size * "
                f"distributed.dp_size = {spec.pipeline.pp_batch_size} * "
                f"{spec.dims.dp} = {spec.global_batch_size} (each step's global "
                f"batch), found {size}; leave it out and pp-core fills it in")


def _check_blocks(spec: Spec, model, problems: list[str]) -> None:
    """``train.activation_checkpointing`` / ``train.compile`` act per block: the model needs some."""
    from pp_core.parallel import find_blocks  # lazy: torch, only when AC or compile is asked for

    mode = spec.train.activation_checkpointing["mode"]
    modes = mode if isinstance(mode, list) else [mode]
    wanted = [key for key, on in (("activation_checkpointing",
                                   any(m != "none" for m in modes)),
                                  ("compile", spec.train.compile["enabled"])) if on]
    if not wanted:
        return
    try:
        find_blocks(model)
    except PPCoreError as exc:
        problems.append(f"train.{wanted[0]}: {exc}")


def _check_expert_parallel(spec: Spec, model, plugins, problems: list[str]) -> None:
    """``distributed.ep_size`` > 1 needs the model's expert-parallel plan, and every planned
    module's ``num_experts`` divisible by it (:func:`~pp_core.parallel.expert.check_expert_parallel`)."""
    ep = spec.dims.ep
    if ep == 1:
        return
    from pp_core.parallel.expert import check_expert_parallel  # lazy: torch, only with EP
    from pp_core.parallel.plan_checks import call_plan_hook, plan_problems, plan_provider

    hook = "pp_expert_parallel_plan"
    try:
        plan = call_plan_hook(plugins, hook, model=model)
    except PPCoreError as exc:  # a plugin raised: named by the facade
        problems.append(str(exc))
        return
    wrong = [] if plan is None else \
        plan_problems(plan, hook, lambda: plan_provider(plugins, hook, model=model))
    if wrong:
        problems.extend(wrong)
        return
    problems.extend(check_expert_parallel(model, plan, ep))


def _check_tensor_parallel(spec: Spec, model, plugins, problems: list[str], notes) -> None:
    """``distributed.tp_size > 1``: a plugin must have a plan for the model, and the plan's
    sharded dimensions and the model's head counts must divide by tp_size."""
    tp, sequence_parallel = spec.dims.tp, spec.dims.sequence_parallel
    if tp <= 1:
        return
    from pp_core.parallel.tensor_parallel import (  # lazy: torch, only with tensor parallelism
        NO_PLAN_HELP, check_tensor_parallel, plan_modules)
    from pp_core.parallel.plan_checks import call_plan_hook, plan_problems, plan_provider

    hook = "pp_tensor_parallel_plan"
    asked = {"model": model, "sequence_parallel": sequence_parallel}
    try:
        plan = call_plan_hook(plugins, hook, **asked)
    except PPCoreError as exc:
        problems.append(str(exc))
        return
    if plan is None:
        problems.append(f"distributed.tp_size: no plugin provides a tensor-parallel plan for the "
                        f"model {type(model).__name__}; {NO_PLAN_HELP}")
        return
    found = plan_problems(plan, hook, lambda: plan_provider(plugins, hook, **asked), model) or \
        check_tensor_parallel(model, dict(plan), tp)
    problems.extend(found)
    if not found:
        notes.append(f"distributed.tp_size: {len(plan_modules(model, plan))} modules sharded "
                     f"{tp} ways (sequence parallel {'on' if sequence_parallel else 'off'})")


def _plan_and_schedule(spec, plugins, model_fn, result: Preflight, problems: list[str]):
    """Plan the split and the schedule on the meta device with the function every rank plans
    with; returns the meta model (``None`` where it could not be built)."""
    config = spec.pipeline
    num_ranks = spec.distributed.pp_size
    sizes = (f" (pp_size={num_ranks}, microbatches = pp_batch_size / pp_microbatch_size = "
             f"{config.num_microbatches})")
    auto = is_auto(config.pp_schedule)
    if spec.train.activation_checkpointing["mode"] == "auto" and not auto:
        problems.append("train.activation_checkpointing.mode: auto is chosen per stage by the "
                        "planner, with pipeline.pp_schedule: auto; set pp_schedule: auto, or a "
                        "mode (none, full, selective)")
    if config.pp_seq_chunks == "auto" and not auto:
        problems.append("pipeline.pp_seq_chunks: auto is chosen by the planner, with pipeline."
                        "pp_schedule: auto; set pp_schedule: auto, or a number of slices")
    try:  # a wrong schedule name or CSV is reported before the model is built
        if not auto:
            schedule_shape(config, num_ranks, plugins)
    except PPCoreError as exc:
        csv = config.pp_schedule_csv is not None
        problems.append(f"pipeline.{schedule_field(config)}: {exc}" + (sizes if csv else ""))
        return None
    model = build_meta_model(spec, model_fn, problems, result.notes, plugins)
    if problems:
        return None
    if model is not None:
        _check_blocks(spec, model, problems)
        check_mixed_precision(spec, model, problems)
        _check_expert_parallel(spec, model, plugins, problems)
        _check_tensor_parallel(spec, model, plugins, problems, result.notes)
    dist = spec.distributed
    if dist.layout == "auto" and dist.elastic:  # pp_core.app.elastic_layouts, at launch
        from pp_core.app.elastic import worlds_of  # lazy: only layout: auto, elastic

        result.notes.append(f"distributed.layout: auto: 'pp-core run' plans the whole layout "
                            f"for each world nnodes {dist.nnodes!r} may give "
                            f"({', '.join(map(str, worlds_of(dist)))} ranks) when it starts; "
                            f"what is checked here is the file's degrees")
    if auto and _splitter(spec) is not None:  # the planner uses it: it must take the model
        from pp_core.planning.split import select_splitter  # lazy: only for auto with a splitter

        try:
            select_splitter(model, config, plugins, _splitter(spec))
        except PPCoreError as exc:
            problems.append(f"model.splitter: {exc}")
            return model
    if auto:  # the launcher profiles the model and chooses; 'pp-core plan' shows the choice
        result.notes.append("pipeline.pp_schedule: auto: the schedule, microbatch size and split "
                            "are chosen when the run starts ('pp-core plan FILE' shows them)")
        return model
    try:
        planned = plan_pipeline(model, config, num_ranks, plugins=plugins,
                                splitter=_splitter(spec))
    except PPCoreError as exc:
        if exc.field in ("pp_schedule", "pp_schedule_csv"):
            problems.append(f"pipeline.{exc.field}: {exc}{sizes}")
        else:
            problems.append(f"pipeline: cannot split the model: {exc}")
        return model
    result.plan, result.schedule = planned.split, planned.schedule
    result.trainable = planned.trainable  # model.lora / model.freeze: frozen stages
    modes = spec.train.activation_checkpointing["mode"]
    if isinstance(modes, list) and len(modes) != planned.split.num_stages:
        problems.append(f"train.activation_checkpointing.mode lists {len(modes)} modes, one per "
                        f"stage, but the pipeline has {planned.split.num_stages} stages; list "
                        f"{planned.split.num_stages} modes, or give one mode for every stage")
    if spec.dims.tp > 1 and not problems:
        _check_stage_plans(spec, model, planned.split, plugins, problems)
    result.initializers = stage_initializers(model, planned.split, planned.schedule, config,
                                             plugins, problems)
    return model


def _check_stage_plans(spec, model, split, plugins, problems: list[str]) -> None:
    """Every stage that holds parameters gets some of them sharded by its tp plan (the plan
    the runtime asks for each part)."""
    from pp_core.parallel.plan_checks import (  # lazy: torch, only with tensor parallelism
        call_plan_hook, unmatched_parts, plan_provider)
    from pp_core.planning.parts import build_model_parts

    hook, sequence_parallel = "pp_tensor_parallel_plan", spec.dims.sequence_parallel

    def plan_of(part):
        try:
            return call_plan_hook(plugins, hook, model=part, sequence_parallel=sequence_parallel)
        except PPCoreError:
            return None

    try:
        parts = [(stage, build_model_parts(model, split, [stage], spec.pipeline)[0])
                 for stage in range(split.num_stages)]
    except Exception:  # noqa: BLE001 - a part the meta device cannot build: nothing to check
        return
    problems.extend(unmatched_parts(parts, plan_of, lambda: plan_provider(
        plugins, hook, model=model, sequence_parallel=sequence_parallel)))
