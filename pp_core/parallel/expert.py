"""Expert parallelism: experts sharded over ranks drawn from the data-parallel ones.

As in torchtitan and Megatron, an expert-parallel (ep) group is ``ep_size`` ranks of one
pipeline rank's dp group: the dp ranks ``0..dp_size-1`` (``dp_rank = replicate_index * dp_shard +
shard_index``) are cut into contiguous blocks of ``ep_size``; each block is an ep group, and the
ranks at the same position of every block (they hold the same experts) form the expert-dp group,
``dp_size / ep_size`` ranks that average the experts' gradients.
:class:`pp_core.parallel.dims.ParallelDims` is the one place that lays this out.

* :func:`apply_expert_parallel` shards the experts of each model part, in place, by the model's
  plan (the ``pp_expert_parallel_plan`` hook; ``{module pattern: style}``). Apply it after
  building the pipeline and before the optimizers and the dp engines (which must leave expert
  parameters alone: :func:`expert_parameters` lists them for ``ignored_params``).
* :func:`sync_expert_gradients` after each step: an expert's gradient holds the contributions of
  every token of its ep group (they came through the all-to-all), so it is summed over the
  expert-dp group and divided by ``dp_size`` - the average over dp ranks the dense parameters get
  from their dp engine.
* The global gradient norm counts each expert once: ``clip_grad_norm(..., ep_group=...)``
  (:mod:`pp_core.parallel.gradients`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from pp_core.errors import ConfigError
from pp_core.parallel.dims import ExpertGroups, build_expert_groups
from pp_core.plugin_manager import plugins_or_default

__all__ = ["ExpertGroups", "expert_parallel_groups", "apply_expert_parallel",
           "expert_parameters", "sync_expert_gradients", "is_expert_parameter",
           "planned_modules"]


def expert_parallel_groups(rank_grid: torch.Tensor, ep_size: int) -> ExpertGroups:
    """Build every ep and expert-dp group (every rank must call this, in the same order) and
    return this rank's: :func:`pp_core.parallel.dims.build_expert_groups`, which
    :meth:`ParallelDims.build <pp_core.parallel.dims.ParallelDims.build>` calls at ``ep > 1``.

    :param rank_grid: the global ranks laid out ``[pp, dp, ...]`` (e.g.
        ``mesh.mesh.reshape(pp, dp_replicate * dp_shard, -1)``).
    :param ep_size: ranks per ep group; must divide the dp size.
    """
    return build_expert_groups(rank_grid, ep_size)


def _plan_of(part: nn.Module, plugins) -> Optional[dict]:
    return plugins.pm.hook.pp_expert_parallel_plan(model=part)


def planned_modules(model: nn.Module, plan: dict) -> list:
    """``(fqn, module, style)`` for every module of ``model`` a pattern of ``plan`` matches."""
    found = []
    for fqn, module in model.named_modules():
        for pattern, style in plan.items():
            if fnmatchcase(fqn, pattern):
                found.append((fqn, module, style))
                break
    return found


def apply_expert_parallel(model_parts, ep_group, plan: Optional[dict] = None,
                          plugins=None) -> int:
    """Shard the experts of every model part over ``ep_group`` (a ProcessGroup or a 1-D
    DeviceMesh), in place; returns how many modules were sharded.

    :param plan: ``{module pattern: style}``; default: the ``pp_expert_parallel_plan`` hook's
        answer for each part. A part the plan does not match is left alone (a stage without
        MoE layers); no plan for any part is a :class:`ConfigError`.
    """
    if hasattr(ep_group, "get_group") and hasattr(ep_group, "ndim"):
        ep_group = ep_group.get_group()
    plugins = plugins_or_default(plugins)
    parts = getattr(model_parts, "model_parts", model_parts)
    sharded, planned = 0, False
    for part in parts:
        part_plan = plan if plan is not None else _plan_of(part, plugins)
        if part_plan is None:
            continue
        planned = True
        for _, module, style in planned_modules(part, part_plan):
            style.apply(module, ep_group)
            sharded += 1
    if not planned:
        names = sorted({type(p).__name__ for p in parts})
        raise ConfigError(f"no expert-parallel plan for {', '.join(names)}: no plugin's "
                          f"pp_expert_parallel_plan answered for it; use a model with MoE "
                          f"layers and a plan (e.g. moe_gpt), or set distributed.ep_size: 1")
    return sharded


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is one rank's share of sharded experts (not replicated over ep)."""
    return bool(getattr(param, "pp_expert_parallel", False))


def expert_parameters(model_parts) -> set:
    """The expert-parallel parameters of ``model_parts`` (for ``ignored_params`` of dp engines)."""
    parts = getattr(model_parts, "model_parts", model_parts)
    return {p for part in parts for p in part.parameters() if is_expert_parameter(p)}


def sync_expert_gradients(params, groups: ExpertGroups) -> None:
    """Average expert gradients as the dp engine averages dense ones: sum over the expert-dp
    group, divide by ``dp_size``. Experts that got no token get zeros first (every rank calls
    the same collectives, so none waits for another)."""
    experts = [p for p in params if is_expert_parameter(p) and p.requires_grad]
    if not experts:
        return
    for param in experts:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    if groups.expert_dp_group is not None:
        flat = torch.cat([p.grad.reshape(-1) for p in experts])
        dist.all_reduce(flat, group=groups.expert_dp_group)
        offset = 0
        for param in experts:
            param.grad.copy_(flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
    if groups.dp_size != 1:
        for param in experts:
            param.grad.div_(groups.dp_size)
