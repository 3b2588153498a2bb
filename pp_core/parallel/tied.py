"""Weights held by several stages: one copy per stage, their gradients summed after each step.

A weight is *tied* across stages when the unsplit model reaches one tensor from modules that land
on different stages: a tied input/output embedding (``model.embed_tokens.weight`` is
``lm_head.weight``), one ``nn.Linear`` object used as ``layers.0`` and ``layers.2``, or a module
that ``module_fqns_per_model_part`` names in several parts (NeMo AutoModel lists
``model.rotary_emb`` in every stage). The unsplit model's gradient of such a weight is the sum of
every use. Split over stages, each rank holds its own copy (a process builds its parts from its
own model; the parts of one rank share the model's tensor, or a splitter unties them per stage as
``hf_decoder`` does), and after backward the copies' gradients are summed over the ranks holding
them - Megatron's "embedding group", done here with point-to-point messages between just those
ranks (a local sum of distinct copies when they share a rank). Afterwards every copy holds the
unsplit model's gradient, bit for bit, so any element-wise optimizer step keeps the copies
identical; the gradient norm counts the weight once
(:func:`pp_core.parallel.gradients.tied_copies`).

A part records what it holds in two attributes (read by both): ``pp_tied_parameters``
(``{local name: every name of the weight}``) and ``pp_tied_stages`` (``{names: stages holding a
copy}``). ``Pipeline.step`` sums the gradients; only what the step added is exchanged, so
gradients accumulated over several steps (no ``zero_grad`` in between) are never counted twice.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedGroup", "tied_groups", "grad_baseline", "sync_tied_gradients_of",
           "align_tied_copies"]


class TiedGroup:
    """One tied weight: its names, the stages holding it, and this rank's copies of it."""

    def __init__(self, names: tuple[str, ...], stages: tuple[int, ...]):
        self.names = names
        self.stages = stages
        self.local: list[nn.Parameter] = []

    def __repr__(self) -> str:
        return f"TiedGroup(names={self.names}, stages={self.stages}, local={len(self.local)})"


def tied_groups(model_parts: Sequence[nn.Module]) -> list[TiedGroup]:
    """The tied weights this rank's parts hold copies of, sorted by their names (so every rank
    walks them in the same order). A copy shared by two local parts is listed once."""
    groups: dict[tuple[str, ...], TiedGroup] = {}
    seen: set[int] = set()
    for part in model_parts:
        inner = getattr(part, "module", None)  # a DDP wrapper: the part is inside
        if not hasattr(part, "pp_tied_parameters") and hasattr(inner, "pp_tied_parameters"):
            part = inner
        tied = getattr(part, "pp_tied_parameters", None)
        if not tied:  # (asked every step: a part without tied weights costs nothing)
            continue
        stages = getattr(part, "pp_tied_stages", {})
        params = dict(part.named_parameters(remove_duplicate=False))
        for name, names in tied.items():
            group = groups.setdefault(names, TiedGroup(names, tuple(stages.get(names, ()))))
            param = params[name]
            if id(param) not in seen:  # two names of one copy: counted once
                seen.add(id(param))
                group.local.append(param)
    return [groups[key] for key in sorted(groups)]


def grad_baseline(model_parts: Sequence[nn.Module]) -> dict:
    """``{id(param): copy of its grad, or None}`` for every local copy of a tied weight."""
    return {id(p): None if p.grad is None else p.grad.detach().clone()
            for tied in tied_groups(model_parts) for p in tied.local}


def _grad(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def sync_tied_gradients_of(model_parts: Sequence[nn.Module], stage_ranks: Sequence[int],
                           rank: int, group=None, baseline: dict | None = None) -> int:
    """Sum the gradients of every tied weight over the stages holding it; return how many.

    :param stage_ranks: ``stage_ranks[s]`` is the rank (in ``group``) that holds stage ``s``.
    :param rank: this process's rank in ``group``.
    :param group: the pipeline's process group (``None``: the default group).
    :param baseline: ``{id(param): grad before the step or None}`` from :func:`grad_baseline`;
        only what each copy gained since then is exchanged and summed. ``None``: sum the whole
        gradients.
    Every rank of the pipeline may call it; ranks holding no tied weight return at once.
    """
    count = 0
    for tied in tied_groups(model_parts):
        if not tied.local or not any(p.requires_grad for p in tied.local):
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


def align_tied_copies(model_parts: Sequence[nn.Module], stage_ranks: Sequence[int], rank: int,
                      group=None) -> int:
    """Give every copy of a tied weight the value of the copy on its lowest stage (each rank
    built its own model, possibly on the meta device or from another seed); return how many.
    Called once by ``build_pipeline`` on every rank, before the first step."""
    count = 0
    for tied in tied_groups(model_parts):
        owner = stage_ranks[min(tied.stages)] if tied.stages else rank
        peers = sorted({stage_ranks[s] for s in tied.stages} - {rank})
        if not tied.local or not peers:
            continue
        with torch.no_grad():
            value = _exchange(tied.local[0].detach(), rank, peers, group, pick=owner)
            for param in tied.local:
                param.copy_(value)
        count += 1
    return count


def _exchange(local: torch.Tensor, rank: int, peers: list[int], group,
              pick: int | None = None) -> torch.Tensor:
    """Send ``local`` to every peer, receive theirs, and add all in rank order (same bits).

    A DTensor gradient (parts under FSDP2 / HSDP / ``replicate``) is exchanged shard by shard:
    each copy has the same shape and is laid out alike over its own dp mesh, so this dp rank's
    shard pairs with the same shard on the peer (the pp group of one dp rank).
    """
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed.tensor, seconds

    if isinstance(local, DTensor):
        summed = _exchange(local.to_local(), rank, peers, group, pick)
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
    if pick is not None:  # the value of one rank's copy, not the sum
        return received[pick]
    total = None
    for r in sorted(received):
        total = received[r].clone() if total is None else total + received[r]
    return total
