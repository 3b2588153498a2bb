"""``build_pipeline``: a model split over the ranks, this rank's :class:`~pp_core.runtime.pipeline.Pipeline`.

``build_pipeline(model, config, pp_group=None, device="cpu")`` plans the split, the schedule (a
registered name or a CSV) and its lowered program with
:func:`~pp_core.planning.plan.plan_pipeline` - the same function ``pp-core validate`` plans with -
keeps only this rank's model parts (moved to ``device``; ``config.dtype`` is the dtype of the
floating tensors stages send and receive, parameters are never cast by it), collects
the runtime initializers and the receive-buffer allocator - all before any pipeline traffic, so
configuration mistakes fail fast and identically on every rank: the ranks check that they agree
on the configuration and the model, then on the schedule and split, before building.
"""

from __future__ import annotations

from torch import nn

from pp_core.config import PipelineConfig
from pp_core.errors import ConfigError
from pp_core.parallel.tied import align_tied_copies
from pp_core.planning.parts import build_model_parts
from pp_core.planning.plan import plan_pipeline
from pp_core.plugin_manager import plugins_or_default
from pp_core.runtime.agreement.build import (check_ranks_agree, config_fields, model_fields,
                                             plan_fields)
from pp_core.runtime.build_checks import check_device, check_materialised, check_not_wrapped
from pp_core.runtime.group import resolve_group
from pp_core.runtime.pipeline import Pipeline

__all__ = ["build_pipeline"]


def build_pipeline(model: nn.Module, config: PipelineConfig, pp_group=None, device="cpu", *,
                   meshes=None, plugins=None, timeout=None, splitter=None) -> Pipeline:
    """Split ``model`` over the ranks of ``pp_group`` and return this rank's :class:`Pipeline`.

    :param pp_group: a ProcessGroup or a 1-D DeviceMesh; ``None`` = ``meshes.pp``, else the
        default group (or a single-process pipeline when torch.distributed is not initialised).
    :param device: where this rank's parts and tensors live (``"cuda:0"``, ``"cpu"``).
    :param plugins: a :class:`pp_core.plugin_manager.Plugins`; default: the installed plugins.
    :param timeout: seconds a single wait may take before the step fails.
    :param splitter: a splitter name or object (``BalancedSplitter(profile)``); None: automatic.
    :param meshes: every mesh and group of the run (:meth:`ParallelDims.build
        <pp_core.parallel.dims.ParallelDims.build>`): a token-normalised loss counts the step's
        valid tokens over ``meshes.loss_group``, and ``step`` finishes the gradients of the
        other parallelisms (:func:`pp_core.parallel.compose.after_step`). Apply them with
        :func:`pp_core.parallel.compose.parallelize` after building. None: pipeline only.
    """
    if not isinstance(config, PipelineConfig):
        raise ConfigError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be an nn.Module, got {type(model).__name__}")

    check_device(device)  # before any collective, each a mistake every rank makes alike
    check_not_wrapped(model)  # a wrapped model's hooks would run collectives of their own
    if getattr(model, "pp_checkpoint", None) is None:  # else each part loads its own weights
        check_materialised(model)
    plugins = plugins_or_default(plugins)
    if pp_group is None and meshes is not None:
        pp_group = meshes.pp
    group, rank, num_ranks = resolve_group(pp_group)
    if num_ranks > 1:  # ranks that disagree would train on wrong gradients, then hang
        check_ranks_agree(group, {**config_fields(config), **model_fields(model)}, device,
                          "configurations or models")
    try:
        plan = plan_pipeline(model, config, num_ranks, rank=rank, plugins=plugins,
                             splitter=splitter)
        failure, built = None, plan_fields(plan.schedule, plan.split)
    except Exception as exc:  # the others must still learn that this rank failed
        failure, built = exc, plan_fields(None, None, exc)
    if num_ranks > 1:  # the same installed plugins plan the same schedule and split
        check_ranks_agree(group, built, device, "schedules or splits")
    if failure is not None:
        raise failure
    parts = build_model_parts(model, plan.split, plan.stage_indices, config, device=device)
    for part in parts:
        check_materialised(part, "a model part of this rank")
    pipe = Pipeline(parts, plan.stage_indices, plan.schedule, config, group, device,
                    program=plan.program, plugins=plugins, timeout=timeout, plan=plan,
                    meshes=meshes)
    if num_ranks > 1 and plan.split.tied_parameters:  # every copy starts as the lowest stage's
        align_tied_copies(pipe.model_parts, plan.schedule.stage_ranks, rank, group)
    return pipe
