"""Expert parallelism, in the library: experts sharded over ranks drawn from the data-parallel ones.

A model supplies only its *plan* (``{module pattern: style}``, from the hook
``pp_expert_parallel_plan`` or a model's own ``expert_parallel_plan()``); everything else is here,
as torchtitan and NeMo AutoModel keep EP's dispatch in the library:

* the layout: :class:`pp_core.parallel.dims.ParallelDims` builds the ep and expert-dp groups
  (:class:`ExpertGroups`; :func:`expert_parallel_groups` for a hand-made mesh). As in torchtitan
  and Megatron, an ep group is ``ep_size`` ranks of one pipeline rank's dp group, and the ranks
  holding the same experts form the expert-dp group;
* :func:`apply_expert_parallel` shards the experts of each model part, in place, by the plan.
  Apply it after building the pipeline and before activation checkpointing, compile and the dp
  engines (which must leave expert parameters alone: :func:`expert_parameters` lists them for
  ``ignored_params``); :func:`check_expert_parallel` says what keeps a plan from ``ep_size``
  ways, one line per problem naming the key (the twin of ``check_tensor_parallel``);
* a style's building blocks: :func:`shard_stacked_experts` keeps this rank's slice of stacked
  expert weights and marks them; :mod:`.dispatch` routes tokens to them and back
  (:func:`dispatch_to_experts`, the all-to-all, the workspace and its runtime initializer);
  :mod:`.aux_loss` injects an auxiliary loss's gradient at the running step's scale;
* the gradients: ``Pipeline.step`` (built with ``meshes=``) calls
  :func:`sync_expert_gradients` (through :func:`pp_core.parallel.compose.after_step`) beside TP's partial-gradient reduction - an expert's gradient
  holds the contributions of every token of its ep group (they came through the all-to-all), so
  it is summed over the expert-dp group and divided by ``dp_size``, the average over dp ranks the
  dense parameters get from their dp engine. The global gradient norm counts each expert once:
  ``clip_grad_norm(..., ep_group=...)`` (:mod:`pp_core.parallel.gradients`).

Patterns match as TP's do (:mod:`pp_core.parallel.plans`: ``*`` is one name), and the rule for
parts is TP's: a part without a plan is left alone, no plan for any part is refused.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from pp_core.errors import ConfigError
from pp_core.parallel.dims import ExpertGroups, build_expert_groups
from pp_core.parallel.expert.aux_loss import aux_loss_modules, inject_aux_loss, scale_aux_losses
from pp_core.parallel.expert.dispatch import (DispatchWorkspace, DispatchWorkspaceInitializer,
                                              dispatch_to_experts, group_name, reset_workspaces,
                                              workspace_for)
from pp_core.parallel.plans import matching_modules, plans_of_parts
from pp_core.plugin_manager import plugins_or_default

__all__ = ["ExpertGroups", "expert_parallel_groups", "expert_parallel_plan",
           "apply_expert_parallel", "check_expert_parallel", "planned_modules",
           "shard_stacked_experts", "expert_parameters", "is_expert_parameter",
           "sync_expert_gradients", "dispatch_to_experts", "workspace_for", "reset_workspaces",
           "DispatchWorkspace", "DispatchWorkspaceInitializer", "group_name", "inject_aux_loss",
           "scale_aux_losses", "aux_loss_modules", "NO_PLAN_HELP"]

NO_PLAN_HELP = ("use a model with MoE layers and a plan (e.g. moe_gpt; a plugin's "
                "pp_expert_parallel_plan or the model's expert_parallel_plan(), docs/plugins.md), "
                "or set distributed.ep_size: 1")

planned_modules = matching_modules
"""``(fqn, module, style)`` for every module of a model a plan's pattern matches (the one
matcher of TP and EP plans, :func:`pp_core.parallel.plans.matching_modules`)."""


def expert_parallel_groups(rank_grid: torch.Tensor, ep_size: int) -> ExpertGroups:
    """Build every ep and expert-dp group (every rank must call this, in the same order) and
    return this rank's: :func:`pp_core.parallel.dims.build_expert_groups`, which
    :meth:`ParallelDims.build <pp_core.parallel.dims.ParallelDims.build>` calls at ``ep > 1``.

    :param rank_grid: the global ranks laid out ``[pp, dp, ...]`` (e.g.
        ``mesh.mesh.reshape(pp, dp_replicate * dp_shard, -1)``).
    :param ep_size: ranks per ep group; must divide the dp size.
    """
    return build_expert_groups(rank_grid, ep_size)


def expert_parallel_plan(model: nn.Module, plugins=None) -> Optional[dict]:
    """The installed plugins' plan for ``model`` (a whole model or one part), or ``None``; a
    plugin that raises is named (the facade's ``Plugins.expert_parallel_plan``)."""
    plan = plugins_or_default(plugins).expert_parallel_plan(model)
    return None if plan is None else dict(plan)


def check_expert_parallel(model: nn.Module, plan: Optional[dict], ep_size: int,
                          key: str = "distributed.ep_size") -> list[str]:
    """What keeps ``plan`` from sharding ``model``'s experts ``ep_size`` ways: each pattern of the
    plan must match a module, and each matched module's ``num_experts`` must divide by ``ep_size``.
    One line per problem, naming the key and the fix; none when the plan fits."""
    if ep_size <= 1:
        return []
    found = matching_modules(model, plan) if plan else []
    if not found:
        return [f"{key}: {ep_size} needs a model with experts and an expert-parallel plan "
                f"(pp_expert_parallel_plan), found none for {type(model).__name__}; "
                f"use e.g. model.name: moe_gpt, or ep_size: 1"]
    for pattern in plan:
        if not matching_modules(model, {pattern: None}):
            return [f"{key}: the expert-parallel plan of {type(model).__name__} names "
                    f"{pattern!r}, which matches no module of the model; correct or remove it "
                    f"(its modules are named like {found[0][0]!r})"]
    for fqn, module, _ in found:
        experts = getattr(module, "num_experts", None)
        if isinstance(experts, int) and experts % ep_size:
            return [f"{key}: {ep_size} does not divide num_experts={experts} of {fqn}; choose "
                    f"an ep_size that divides model.args.num_experts"]
    return []


def apply_expert_parallel(model_parts, ep_group, plan: Optional[dict] = None,
                          plugins=None) -> int:
    """Shard the experts of every model part over ``ep_group`` (a ProcessGroup or a 1-D
    DeviceMesh), in place; returns how many modules were sharded.

    :param plan: ``{module pattern: style}`` for every part (a style has ``apply(module,
        ep_group)``); default: each part's plan from :func:`expert_parallel_plan`. A part without
        a plan is left alone (a stage without MoE layers); no plan for any part is a
        :class:`ConfigError`.
    """
    if hasattr(ep_group, "get_group") and hasattr(ep_group, "ndim"):
        ep_group = ep_group.get_group()
    planned = plans_of_parts(model_parts, plan, lambda part: expert_parallel_plan(part, plugins))
    if not planned:
        parts = getattr(model_parts, "model_parts", model_parts)
        names = sorted({type(p).__name__ for p in parts})
        raise ConfigError(f"no expert-parallel plan for {', '.join(names)}: no plugin's "
                          f"pp_expert_parallel_plan answered for it; {NO_PLAN_HELP}")
    sharded = 0
    for part, part_plan in planned:
        for _, module, style in matching_modules(part, part_plan):
            style.apply(module, ep_group)
            sharded += 1
    return sharded


def shard_stacked_experts(owner: nn.Module, names, num_experts: int, ep_group) -> tuple:
    """Keep this ep rank's contiguous ``num_experts / ep_size`` experts of the stacked weights
    ``owner.<name>`` (``[num_experts, ...]`` each), marked ``pp_expert_parallel``; returns
    ``(experts_per_rank, ep_rank, ep_size)``."""
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if num_experts % size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={size}")
    local = num_experts // size
    keep = slice(rank * local, (rank + 1) * local)
    for name in names:
        old = getattr(owner, name)
        new = nn.Parameter(old.detach()[keep].clone(), requires_grad=old.requires_grad)
        new.pp_expert_parallel = True  # not replicated over the ep group (norms, dp sync)
        setattr(owner, name, new)
    return local, rank, size


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
    the same collectives, so none waits for another). ``Pipeline.step`` calls it when built
    with ``meshes=`` at ep > 1."""
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
