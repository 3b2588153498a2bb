"""Gradients across data-parallel replicas of a pipeline: one all-reduce per step, and clipping.

Each dp rank runs the whole pipeline on its slice of the global batch; after ``Pipeline.step``
its parameters' ``.grad`` hold the gradient of the *sum* of its microbatch losses (of their mean
with ``scale_grads_in_schedule``). :class:`GradientSync` turns that into the gradient of the mean
loss over every microbatch of the global batch, which is exactly what one process computing the
global batch with gradient accumulation would get:

    grad = all_reduce_sum(local grad) / (dp_size * (num_microbatches, or 1 if already scaled))

It reduces once per step, not once per microbatch — what ``patch_stage_backward_maybe_with_nosync``
buys torch's DDP/FSDP stages — in DDP's way: gradients flattened into ~25 MiB buckets per dtype,
one ``torch.distributed.all_reduce`` per bucket on the dp process group.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientSync", "clip_grad_norm", "tied_copies"]

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


class GradientSync:
    """Average gradients over the dp group once per step (and apply the microbatch scaling)."""

    def __init__(self, parts: Iterable[nn.Module], dp_group, dp_size: int, num_microbatches: int,
                 grads_already_scaled: bool, bucket_bytes: int = BUCKET_BYTES):
        self.params = [p for part in parts for p in part.parameters() if p.requires_grad]
        self.group, self.dp_size = dp_group, dp_size
        self.factor = 1.0 / (dp_size * (1 if grads_already_scaled else num_microbatches))
        self.buckets = self._buckets(bucket_bytes)
        self.calls = 0  # all-reduces issued so far (tests check: buckets per step)

    def _buckets(self, bucket_bytes: int) -> list[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = []
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in self.params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for group in by_dtype.values():
            current, size = [], 0
            for param in group:
                nbytes = param.numel() * param.element_size()
                if current and size + nbytes > bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(param)
                size += nbytes
            if current:
                buckets.append(current)
        return buckets

    def __call__(self) -> None:
        """Scale, then (when dp_size > 1) all-reduce every bucket; a missing grad counts as zero."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if self.dp_size == 1:
            for param in self.params:
                param.grad.mul_(self.factor)
            return
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]).mul_(self.factor)
            dist.all_reduce(flat, group=self.group)
            self.calls += 1
            offset = 0
            for param in bucket:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count


def tied_copies(model_parts, stage_indices) -> set[int]:
    """``id``s of this rank's parameters that are extra copies of a weight tied across stages.

    A splitter that unties a shared weight (``pp_transformers``: ``embed_tokens`` / ``lm_head``)
    marks each part with ``pp_tied_parameters`` (``{local name: every name of the weight}``) and
    ``pp_tied_stages`` (``{names: stages holding a copy}``). The copy on the lowest stage stands
    for the weight; the others are skipped when norms are summed, so the norm is the unsplit
    model's.
    """
    extra = set()
    for part, stage in zip(model_parts, stage_indices):
        holders = getattr(part, "pp_tied_stages", {})
        named = dict(part.named_parameters(remove_duplicate=False))
        for name, names in getattr(part, "pp_tied_parameters", {}).items():
            stages = holders.get(names, ())
            if stages and stage != min(stages):
                extra.add(id(named[name]))
    return extra


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None, pp_group,
                   skip: set[int] = frozenset()) -> float:
    """The global gradient norm over every pipeline stage; clips to ``max_norm`` when given.

    Each pipeline rank holds different parameters, so squared norms are summed over the pp group
    (after the dp all-reduce every dp replica holds the same gradients). Parameters whose ``id``
    is in ``skip`` (extra copies of tied weights, see :func:`tied_copies`) are clipped but not
    counted.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        if param.grad is not None and id(param) not in skip:
            squares += param.grad.detach().double().pow(2).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    norm = math.sqrt(float(squares))
    if max_norm is not None and grads:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for grad in grads:
                grad.mul_(coefficient)
    return norm
