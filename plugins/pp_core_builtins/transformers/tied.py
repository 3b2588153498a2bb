"""Tied input/output embeddings across stages: sum their gradients after backward.

With ``tie_word_embeddings=True`` the unsplit model uses one tensor as ``model.embed_tokens.weight``
(first stage) and ``lm_head.weight`` (last stage), and its gradient is the sum of both uses. Split
over stages, each holder has its own copy and sees only its own use. Megatron keeps an "embedding
group" of the first and last pipeline ranks and all-reduces the two gradients before the
optimizer step; this module does the same with point-to-point messages between just those ranks
(no extra process group to create, nothing asked of the other ranks), or a local sum when both
stages are on one rank (V placement). Afterwards both copies hold the unsplit model's gradient,
bit for bit, so any element-wise optimizer step keeps them identical.

``Pipeline.step`` does it for you: the plugin's ``pp_pipeline_step`` wrapper notes each copy's
gradient before the step and, after it, exchanges only what the step added, so gradients
accumulated over several steps (no ``zero_grad`` in between) are never counted twice.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


__all__ = ["TiedGroup", "tied_groups", "grad_baseline", "sync_tied_gradients",
           "sync_tied_gradients_of"]


class TiedGroup:
    """One tied weight: its names, the stages holding it, and this rank's copies of it."""

    def __init__(self, names: tuple[str, ...], stages: tuple[int, ...]):
        self.names = names
        self.stages = stages
        self.local: list[nn.Parameter] = []

    def __repr__(self) -> str:
        return f"TiedGroup(names={self.names}, stages={self.stages}, local={len(self.local)})"


def tied_groups(model_parts: Sequence[nn.Module]) -> list[TiedGroup]:
    """The tied weights this rank's parts hold copies of (from ``part.pp_tied_parameters``)."""
    groups: dict[tuple[str, ...], TiedGroup] = {}
    for part in model_parts:
        stages = getattr(part, "pp_tied_stages", {})
        params = dict(part.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        for name, names in getattr(part, "pp_tied_parameters", {}).items():
            group = groups.setdefault(names, TiedGroup(names, tuple(stages.get(names, ()))))
            param = params[name]
            if id(param) not in seen:  # two names of one weight on one stage: one copy
                seen.add(id(param))
                group.local.append(param)
    return list(groups.values())


def _grad(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def sync_tied_gradients_of(model_parts: Sequence[nn.Module], stage_ranks: Sequence[int],
                           rank: int, group=None, baseline: dict | None = None) -> int:
    """Sum the gradients of every tied weight over the stages holding it; return how many.

    :param stage_ranks: ``stage_ranks[s]`` is the rank (in ``group``) that holds stage ``s``.
    :param rank: this process's rank in ``group``.
    :param group: the pipeline's process group (``None``: the default group).
    :param baseline: ``{id(param): grad before the step or None}`` from :func:`grad_baseline`;
        only what each copy gained since then is exchanged and summed, so gradients accumulated
        over earlier steps are not counted twice. ``None``: sum the whole gradients.
    Every rank of the pipeline may call it; ranks holding no tied weight return at once.
    """
    count = 0
    for tied in tied_groups(model_parts):
        if not tied.local:
            continue
        before = [None if baseline is None else baseline.get(id(p)) for p in tied.local]
        local = None
        for param, old in zip(tied.local, before):
            gained = _grad(param) if old is None else _grad(param) - old
            local = gained if local is None else local + gained
        peers = sorted({stage_ranks[s] for s in tied.stages} - {rank})
        total = _exchange(local, rank, peers, group) if peers else local
        for param, old in zip(tied.local, before):
            param.grad = total.clone() if old is None else old + total
        count += 1
    return count


def grad_baseline(model_parts: Sequence[nn.Module]) -> dict:
    """``{id(param): copy of its grad, or None}`` for every local copy of a tied weight."""
    return {id(p): None if p.grad is None else p.grad.detach().clone()
            for tied in tied_groups(model_parts) for p in tied.local}


def _exchange(local: torch.Tensor, rank: int, peers: list[int], group) -> torch.Tensor:
    """Send ``local`` to every peer, receive theirs, and add all in rank order (same bits).

    A DTensor gradient (parts under FSDP2 / HSDP / ``replicate``) is exchanged shard by shard:
    each copy of a tied weight has the same shape and is laid out alike over its own dp mesh, so
    this dp rank's shard pairs with the same shard on the peer (the pp group of one dp rank);
    the reduced gradients are already averaged over dp, so the sum is the unsplit model's.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor):
        summed = _exchange(local.to_local(), rank, peers, group)
        return DTensor.from_local(summed, local.device_mesh, local.placements,
                                  shape=local.shape, stride=local.stride())

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    local = local.contiguous()
    received = {peer: torch.empty_like(local) for peer in peers}
    ops = []
    for peer in peers:
        ops.append(dist.P2POp(dist.isend, local, global_rank(peer), group))
        ops.append(dist.P2POp(dist.irecv, received[peer], global_rank(peer), group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    received[rank] = local
    total = None
    for r in sorted(received):
        total = received[r].clone() if total is None else total + received[r]
    return total


def sync_tied_gradients(pipe, baseline: dict | None = None) -> int:
    """:func:`sync_tied_gradients_of` for a :class:`pp_core.runtime.Pipeline`.

    ``Pipeline.step`` already does this (``pp_core_builtins.transformers.pp_pipeline_step``); call it
    yourself only for gradients produced outside ``step``.
    """
    return sync_tied_gradients_of(pipe.model_parts, pipe.schedule.stage_ranks, pipe.rank,
                                  pipe.group, baseline)
