"""One pipeline stage on this rank: its model part, its neighbours, and the stage I/O contract.

The contract (docs/runtime.md, "the stage I/O contract"): the first stage is called as
``forward(x)`` for a tensor microbatch, ``forward(*x)`` for a tuple or list, ``forward(**x)`` for a
dict; a later stage as ``forward(*outs)`` where ``outs`` is the previous stage's output (a tensor,
or a tuple of tensors). Integer and boolean tensors cross stages without gradients. The last
stage's output goes to the loss function unchanged. Keyword inputs every stage needs (``step(...,
stage_kwargs={"position_ids": ...})``) are added to every call as ``**kwargs``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pp_core.errors import PipelineError

__all__ = ["Stage", "as_outputs", "make_stage_inputs"]


class Stage:
    """A model part with its place in the pipeline."""

    def __init__(self, index: int, module: nn.Module, stage_ranks: tuple[int, ...], rank: int):
        self.index = index
        self.module = module
        self.num_stages = len(stage_ranks)
        self.is_first = index == 0
        self.is_last = index == self.num_stages - 1
        self.prev_rank = None if self.is_first else stage_ranks[index - 1]
        self.next_rank = None if self.is_last else stage_ranks[index + 1]
        self.local_prev = self.prev_rank == rank
        self.local_next = self.next_rank == rank

    def __call__(self, inputs: Any, kwargs: Optional[dict] = None) -> Any:
        module = self.module
        kwargs = kwargs or {}
        if not self.is_first:
            return module(*inputs, **kwargs)
        if isinstance(inputs, dict):
            return module(**inputs, **kwargs)
        if isinstance(inputs, (tuple, list)):
            return module(*inputs, **kwargs)
        return module(inputs, **kwargs)

    def __repr__(self) -> str:
        return f"Stage({self.index}, {type(self.module).__name__})"


def as_outputs(value: Any, stage: int, dtype) -> tuple[torch.Tensor, ...]:
    """A non-last stage's output as a tuple of tensors (floating ones cast to ``dtype``)."""
    items = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in items):
        kind = type(value).__name__
        if isinstance(items, (tuple, list)):
            kind = f"{kind} of ({', '.join(type(t).__name__ for t in items)})"
        raise PipelineError(
            f"stage {stage} returned {kind}; a stage that is not the last must return a tensor "
            f"or a tuple of tensors (the next stage is called as forward(*outputs)); return "
            f"tensors only, e.g. (hidden, attention_mask)")
    if dtype is not None:
        items = [t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in items]
    return tuple(items)


def make_stage_inputs(tensors, grad_enabled: bool) -> tuple[torch.Tensor, ...]:
    """Leaf tensors for the next stage: detached, requiring grad iff they carry a gradient."""
    result = []
    for tensor in tensors:
        leaf = tensor.detach()
        if grad_enabled and tensor.requires_grad:
            leaf.requires_grad_(True)
        result.append(leaf)
    return tuple(result)
