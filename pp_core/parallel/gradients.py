"""Gradients of a pipeline's parts after a step: their final scaling, tied copies, clipping.

Data parallelism itself is torch's (FSDP2 / HSDP / ``replicate``, applied with
:func:`pp_core.parallel.apply_data_parallel`; ``Pipeline.step`` makes each engine reduce once per
step, averaging over the dp ranks). What is left for the training loop: scaling the sum of
microbatch gradients to their mean when the schedule did not, and the global gradient norm over
every stage and shard, with DTensor gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["finish_gradients", "clip_grad_norm", "tied_copies"]


def finish_gradients(params: list[nn.Parameter], num_microbatches: int) -> None:
    """Divide by ``num_microbatches`` (1 when the schedule scaled already); a parameter that got
    no gradient gets zeros, so the optimizer steps every parameter alike on every rank."""
    for param in params:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif num_microbatches != 1:
            param.grad.div_(num_microbatches)


def tied_copies(model_parts, stage_indices) -> set[int]:
    """``id``s of this rank's parameters that are extra copies of a weight tied across stages.

    Parts holding a weight other stages hold too (pp_core's own marking, or a splitter that
    unties a shared weight: ``pp_core_builtins.transformers``' ``embed_tokens`` / ``lm_head``)
    carry ``pp_tied_parameters`` (``{local name: every name of the
    weight}``) and ``pp_tied_stages`` (``{names: stages holding a copy}``). The copy on the lowest
    stage stands for the weight; the others are skipped when norms are summed, so the norm is the
    unsplit model's.
    """
    extra, counted = set(), set()
    for part, stage in zip(model_parts, stage_indices):
        holders = getattr(part, "pp_tied_stages", {})
        named = dict(part.named_parameters(remove_duplicate=False))
        for name, names in getattr(part, "pp_tied_parameters", {}).items():
            stages = holders.get(names, ())
            if stages and stage != min(stages):
                extra.add(id(named[name]))
            else:  # one tensor shared by this rank's parts counts where the lowest stage has it
                counted.add(id(named[name]))
    return extra - counted


def _squared_norm(params: list[nn.Parameter], skip: set[int], device) -> torch.Tensor:
    """Sum of squared gradient entries on this pp rank, whole over every dp shard.

    A DTensor gradient sharded over some mesh dims (FSDP2) holds a slice: the local squares are
    summed, then all-reduced over those dims (one collective per mesh and dims, not per tensor).
    A replicated one (``replicate``, HSDP's replicate dim) counts its local copy once.
    """
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed.tensor, seconds

    total = torch.zeros((), dtype=torch.float64, device=device)
    sharded: dict[tuple, torch.Tensor] = {}
    for param in params:
        grad = param.grad
        if grad is None or id(param) in skip:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        square = local.detach().double().pow(2).sum()
        # sharded over a dim: anything neither replicated nor a pending sum (Shard, and the
        # _StridedShard of a fused tensor-parallel weight, whose is_shard() is False)
        dims = tuple(i for i, place in enumerate(grad.placements)
                     if not (place.is_replicate() or place.is_partial())) \
            if isinstance(grad, DTensor) else ()
        if dims:
            key = (grad.device_mesh, dims)
            sharded[key] = sharded.get(key, 0) + square
        else:
            total += square
    for (mesh, dims), square in sharded.items():
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        total += square
    return total


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None, pp_group,
                   skip: set[int] = frozenset(), ep_group=None) -> float:
    """The global gradient norm over every pipeline stage and dp shard; clips to ``max_norm``.

    Each pipeline rank holds different parameters, so squared norms are summed over the pp group
    (every dp replica holds the same reduced gradients). Parameters whose ``id`` is in ``skip``
    (extra copies of tied weights, see :func:`tied_copies`) are clipped but not counted.
    ``ep_group``: with expert parallelism, the parameters marked ``pp_expert_parallel`` (each ep
    rank holds different experts) are summed over it first, so each expert counts once and each
    dense parameter once; every rank of the group joins that all-reduce, experts with gradients
    or not.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    experts = {id(p) for p in params if getattr(p, "pp_expert_parallel", False)} \
        if ep_group is not None else set()
    squares = _squared_norm(params, set(skip) | experts, device)
    if ep_group is not None:
        local = _squared_norm([p for p in params if id(p) in experts], set(skip), device)
        if dist.get_world_size(ep_group) > 1:
            dist.all_reduce(local, group=ep_group)
        squares = squares + local
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    norm = math.sqrt(float(squares))
    if max_norm is not None and grads:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)
    return norm
