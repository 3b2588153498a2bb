"""One pipeline stage on this rank: its model part, its neighbours, and the stage I/O contract.

The contract (docs/runtime.md, "the stage I/O contract"): the first stage is called as
``forward(x)`` for a tensor microbatch, ``forward(*x)`` for a tuple or list, ``forward(**x)`` for a
dict; a later stage as ``forward(*outs)`` where ``outs`` is the previous stage's output (a tensor,
or a tuple of tensors). Integer and boolean tensors cross stages without gradients. The last
stage's output goes to the loss function unchanged. Keyword inputs every stage needs (``step(...,
stage_kwargs={"position_ids": ...})``) are added to every call as ``**kwargs``.

A later stage's inputs that need a gradient are leaves the runtime made (the tensor received, or
the previous local stage's output detached), and torch refuses an in-place operation on a leaf
that requires grad. Unsplit, the same tensor is an intermediate result, so a block that starts
with ``x.mul_(2)`` trains. The stage is therefore called with :func:`handed` inputs: each such
leaf passed through an identity autograd node that shares its storage (no copy), so the part may
change its input in place and the gradient still reaches the leaf the backward asks for.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pp_core.errors import PipelineError

__all__ = ["Stage", "as_outputs", "make_stage_inputs", "local_outputs", "as_dtensors"]


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
        # frozen stages (pp_core.runtime.frozen.mark_frozen): a stage before the first trainable
        # one runs no backward; the first trainable one takes no gradient for its inputs
        self.runs_backward = True
        self.input_grads = not self.is_first

    def __call__(self, inputs: Any, kwargs: Optional[dict] = None) -> Any:
        module = self.module
        kwargs = kwargs or {}
        if not self.is_first:
            return module(*handed(inputs), **kwargs)
        if isinstance(inputs, dict):
            return module(**inputs, **kwargs)
        if isinstance(inputs, (tuple, list)):
            return module(*inputs, **kwargs)
        return module(inputs, **kwargs)

    def __repr__(self) -> str:
        return f"Stage({self.index}, {type(self.module).__name__})"

    def dtensor_mesh(self, placements):
        """The device mesh a received DTensor lives on here: that of the part's DTensor
        parameters with as many dimensions as ``placements`` (its tp mesh). Asked once."""
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            meshes = self._meshes = {}
            from torch.distributed.tensor import DTensor  # lazy: only stages that get DTensors

            for param in self.module.parameters():
                if isinstance(param, DTensor):
                    meshes.setdefault(param.device_mesh.ndim, param.device_mesh)
        mesh = meshes.get(len(placements))
        if mesh is None:
            raise PipelineError(
                f"stage {self.index} received a DTensor (placements {tuple(placements)}) but its "
                f"model part has no {len(placements)}-D DTensor parameters to take the device "
                f"mesh from; apply tensor parallelism to this stage too "
                f"(pp_core.parallel.apply_tensor_parallel), or return .to_local() from stage "
                f"{self.index - 1}")
        return mesh


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


class _Handoff(torch.autograd.Function):
    """Identity: the same storage as a new non-leaf tensor (its version counter is shared, so a
    tensor the sender's graph saved is still checked as it is unsplit)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def handed(inputs) -> tuple:
    """A later stage's inputs as its part receives them: every plain leaf that requires grad
    behind an identity node (the module docstring says why)."""
    return tuple(_Handoff.apply(t) if type(t) is torch.Tensor and t.requires_grad and t.is_leaf
                 else t for t in inputs)


def make_stage_inputs(tensors, grad_enabled: bool) -> tuple[torch.Tensor, ...]:
    """Leaf tensors for the next stage: detached, requiring grad iff they carry a gradient."""
    result = []
    for tensor in tensors:
        leaf = tensor.detach()
        if grad_enabled and tensor.requires_grad:
            leaf.requires_grad_(True)
        result.append(leaf)
    return tuple(result)


def local_outputs(outs: tuple) -> tuple[tuple, Optional[tuple]]:
    """A stage's outputs with every DTensor replaced by its local shard (differentiably, so its
    gradient comes back as a local shard too), and the placements of each output (``()`` for a
    plain tensor; ``None`` when no output is a DTensor)."""
    if not any(type(t) is not torch.Tensor and hasattr(t, "to_local") for t in outs):
        return outs, None
    return (tuple(t.to_local() if hasattr(t, "to_local") else t for t in outs),
            tuple(tuple(t.placements) if hasattr(t, "to_local") else () for t in outs))


def as_dtensors(stage: Stage, leaves: tuple, placements) -> tuple:
    """The next stage's inputs: each leaf whose sender had a DTensor becomes a DTensor again
    (``DTensor.from_local`` on this stage's tp mesh, differentiable: the leaf's gradient is the
    local shard of the input gradient); plain tensors pass as they are."""
    if not placements or not any(placements):
        return leaves
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed

    return tuple(DTensor.from_local(leaf, stage.dtensor_mesh(places), places, run_check=False)
                 if places else leaf for leaf, places in zip(leaves, placements))
