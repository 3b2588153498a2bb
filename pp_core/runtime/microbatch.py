"""Splitting a step's batch into microbatches, counting tokens, merging outputs.

Every tensor is split along dim 0 into ``num_microbatches`` equal views (no copy); tuples, lists
and dicts are split element-wise and keep their type; any other value (``None``, an int, a
string, a mask shared by the whole batch that is *not* a tensor) is passed unchanged to every
microbatch. A tensor whose dim 0 is not the batch size is a usage error, reported before any
communication.

The same splitting (:func:`split_batch`) cuts a data-parallel step's global batch into the dp
ranks' shares (:func:`pp_core.app.factories.dp_slice`); only the message of a mismatch differs.

Token count rule - the one pp-core counts tokens by: ``num_tokens`` passed to runtime
initializers, and the tokens per step and tokens/s a run reports: the ``numel()`` of the first
integer tensor in the microbatch (token ids, in traversal order: positional items, then dict
values in insertion order); if there is none, ``shape[0] * shape[1]`` of the first tensor
(``shape[0]`` when it is 1-D, 1 when 0-D); 0 when the microbatch holds no tensor. On a rank
without the step's inputs the same rule is applied to the tensors the stage received.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pp_core.errors import ConfigError

__all__ = ["split_batch", "split_microbatches", "num_tokens", "to_device", "merge_microbatches", "first_tensor",
           "iter_tensors"]


def iter_tensors(value):
    """Every tensor in ``value``: a tensor, or tuples/lists/dicts of them, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def first_tensor(value) -> Optional[torch.Tensor]:
    return next(iter_tensors(value), None)


def split_batch(value: Any, pieces: int, batch_size: int,
                mismatch: Callable[[str, torch.Tensor], Exception]) -> list:
    """``value`` cut into ``pieces`` equal views along dim 0 (see the module docstring).

    :param mismatch: ``mismatch(path, tensor)`` makes the error raised for a tensor whose dim 0
        is not ``batch_size`` (``path`` locates it, e.g. ``"[0]['ids']"``).
    """
    size = batch_size // pieces

    def split(item, path):
        if isinstance(item, torch.Tensor):
            if item.dim() == 0 or item.shape[0] != batch_size:
                raise mismatch(path, item)
            return item.split(size)
        if isinstance(item, (tuple, list)):
            parts = [split(x, f"{path}[{i}]") or [x] * pieces for i, x in enumerate(item)]
            return [_rebuild(item, [p[k] for p in parts]) for k in range(pieces)]
        if isinstance(item, dict):
            parts = {key: split(x, f"{path}[{key!r}]") or [x] * pieces
                     for key, x in item.items()}
            return [{key: parts[key][k] for key in item} for k in range(pieces)]
        return None  # passed through unchanged

    result = split(value, "")
    return [value] * pieces if result is None else list(result)


def split_microbatches(value: Any, num_microbatches: int, batch_size: int, what: str) -> list:
    """``value`` cut into ``num_microbatches`` along dim 0 (see the module docstring).

    :param what: ``"inputs"`` or ``"target"``, for the error message.
    :raises ConfigError: a tensor whose dim 0 is not ``batch_size``.
    """
    size = batch_size // num_microbatches

    def mismatch(path, item):
        got = "a 0-d tensor" if item.dim() == 0 else f"batch size {item.shape[0]}"
        return ConfigError(
            f"{what}{path} has {got} (shape {tuple(item.shape)}), but pp_batch_size="
            f"{batch_size}: every tensor of a step's {what} must have dim 0 = pp_batch_size, "
            f"split into {num_microbatches} microbatches of {size}; pass a batch of "
            f"{batch_size} or change pp_batch_size")

    return split_batch(value, num_microbatches, batch_size, mismatch)


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(like, items: list):
    return type(like)(*items) if _is_namedtuple(like) else type(like)(items)


def to_device(value: Any, device: torch.device, dtype: Optional[torch.dtype]) -> Any:
    """Move every tensor to ``device``; cast floating tensors to ``dtype`` when it is set."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            return value.to(device=device, dtype=dtype, non_blocking=True)
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return _rebuild(value, [to_device(x, device, dtype) for x in value])
    if isinstance(value, dict):
        return {key: to_device(x, device, dtype) for key, x in value.items()}
    return value


def num_tokens(value: Any) -> int:
    """The token count of one microbatch (rule in the module docstring)."""
    first = None
    for tensor in iter_tensors(value):
        if first is None:
            first = tensor
        if not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool:
            return tensor.numel()
    if first is None:
        return 0
    if first.dim() == 0:
        return 1
    return first.shape[0] * (first.shape[1] if first.dim() > 1 else 1)


def merge_microbatches(outputs: list) -> Any:
    """Concatenate per-microbatch outputs along dim 0 (tensors, tuples, lists, dicts)."""
    head = outputs[0]
    if isinstance(head, torch.Tensor):
        return torch.cat(outputs) if head.dim() else torch.stack(outputs)
    if isinstance(head, (tuple, list)):
        return _rebuild(head, [merge_microbatches([out[i] for out in outputs])
                               for i in range(len(head))])
    if isinstance(head, dict):
        return {key: merge_microbatches([out[key] for out in outputs]) for key in head}
    return outputs
