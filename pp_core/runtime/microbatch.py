"""Splitting a step's batch into microbatches, counting tokens, merging outputs.

Every tensor is split along dim 0 (or the dim a model declares for a keyword input:
:func:`kwargs_chunk_dims`) into ``num_microbatches`` equal views (no copy); a keyword input whose
rows belong to samples unevenly (a vision-language model's images: 0..n per sample, patches per
image) is cut by the sample each row belongs to, as the model says
(``get_pipeline_kwargs_samples``), into views of uneven length; tuples, lists
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
           "iter_tensors", "kwargs_chunk_dims", "kwargs_samples"]


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
                mismatch: Callable[[str, torch.Tensor], Exception],
                dims: Optional[dict] = None) -> list:
    """``value`` cut into ``pieces`` equal views along dim 0 (see the module docstring).

    :param mismatch: ``mismatch(path, tensor)`` makes the error raised for a tensor whose batch
        dim is not ``batch_size`` (``path`` locates it, e.g. ``"[0]['ids']"``).
    :param dims: ``{key: dim}`` for a dict ``value``: the batch dimension of those keys' tensors
        (e.g. ``{"position_ids": 1}`` for mRoPE ids shaped ``[3, batch, seq]``); others use 0.
        A value that is a tensor instead of an int is the sample of each row of that key's
        tensor (:func:`kwargs_chunk_dims`): piece ``k`` gets the rows of its samples.
    """
    size = batch_size // pieces

    def split(item, path, dim=0):
        if isinstance(dim, torch.Tensor):
            if not isinstance(item, torch.Tensor) or item.dim() == 0 or \
                    item.shape[0] != dim.numel():
                raise mismatch(path, item)
            bounds = torch.searchsorted(dim, torch.arange(0, batch_size + 1, size)).tolist()
            if bounds[0] != 0 or bounds[-1] != dim.numel():  # a sample outside the batch
                raise mismatch(path, item)
            return tuple(item[bounds[k]:bounds[k + 1]] for k in range(pieces))
        if isinstance(item, torch.Tensor):
            if item.dim() <= dim or item.shape[dim] != batch_size:
                raise mismatch(path, item)
            return item.split(size, dim=dim)
        if isinstance(item, (tuple, list)):
            parts = [split(x, f"{path}[{i}]", dim) or [x] * pieces for i, x in enumerate(item)]
            return [_rebuild(item, [p[k] for p in parts]) for k in range(pieces)]
        if isinstance(item, dict):
            parts = {key: split(x, f"{path}[{key!r}]", dim) or [x] * pieces
                     for key, x in item.items()}
            return [{key: parts[key][k] for key in item} for k in range(pieces)]
        return None  # passed through unchanged

    if dims and isinstance(value, dict):
        parts = {key: split(x, f"[{key!r}]", dims.get(key, 0)) or [x] * pieces
                 for key, x in value.items()}
        return [{key: parts[key][k] for key in value} for k in range(pieces)]

    result = split(value, "")
    return [value] * pieces if result is None else list(result)


def split_microbatches(value: Any, num_microbatches: int, batch_size: int, what: str,
                       dims: Optional[dict] = None) -> list:
    """``value`` cut into ``num_microbatches`` along dim 0, or along ``dims[key]`` for the keys
    of a dict ``value`` that a model declares (:func:`kwargs_chunk_dims`).

    :param what: ``"inputs"`` or ``"target"``, for the error message.
    :raises ConfigError: a tensor whose batch dim is not ``batch_size``.
    """
    size = batch_size // num_microbatches
    dims = dims or {}

    def mismatch(path, item):
        key = path[2:-2] if path.startswith("['") else None
        dim = dims.get(key, 0)
        if isinstance(dim, torch.Tensor):
            return ConfigError(
                f"{what}{path} has shape {tuple(getattr(item, 'shape', ()))}, but the model's "
                f"get_pipeline_kwargs_samples gives the sample of {dim.numel()} rows; its dim 0 "
                f"must hold one row per entry the model counts (an image, a patch)")
        got = f"only {item.dim()} dims" if item.dim() <= dim else \
            f"batch size {item.shape[dim]} in dim {dim}"
        declared = f" (the model's get_pipeline_kwargs_chunk_dims says dim {dim})" if dim else ""
        return ConfigError(
            f"{what}{path} has {got} (shape {tuple(item.shape)}){declared}, but pp_batch_size="
            f"{batch_size}: every tensor of a step's {what} must have its batch dim (0 unless "
            f"the model declares another) = pp_batch_size, split into {num_microbatches} "
            f"microbatches of {size}; pass a batch of {batch_size} or change pp_batch_size")

    return split_batch(value, num_microbatches, batch_size, mismatch, dims)


def kwargs_chunk_dims(model, kwargs: Any) -> dict:
    """``{key: dim}``: the batch dimension of keyword inputs whose batch dim is not 0, as the
    model declares it in NeMo AutoModel's ``get_pipeline_kwargs_chunk_dims(kwargs)`` (e.g.
    ``{"position_ids": 1}`` for mRoPE ids ``[3, batch, seq]``), and ``{key: samples}`` for the
    keyword inputs whose rows belong to samples unevenly, as the model declares them in
    ``get_pipeline_kwargs_samples(kwargs)`` (:func:`kwargs_samples`); ``{}`` when the model
    has neither method or ``kwargs`` is not a dict.

    :raises ConfigError: the method names a key ``kwargs`` does not hold, or a dim that is not
        a non-negative int.
    """
    if not isinstance(kwargs, dict):
        return {}

    def bad_dim(key, dim):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            return f"gives {key!r} the dim {dim!r}; a batch dim is an int >= 0"
        return None

    dims = _answer(model, "get_pipeline_kwargs_chunk_dims", kwargs,
                   "{keyword: batch dim}, e.g. {'position_ids': 1}", bad_dim)
    return {**dims, **kwargs_samples(model, kwargs)}


def _answer(model, method: str, kwargs: dict, form: str, bad) -> dict:
    """``model.<method>(kwargs)``, checked: a dict (of ``form``) naming only keys of ``kwargs``,
    each value accepted by ``bad(key, value)`` (``None``, else what is wrong); ``{}`` when the
    model has no such method."""
    hook = getattr(model, method, None)
    if hook is None:
        return {}
    found = hook(kwargs) or {}
    where = f"{type(model).__name__}.{method}"
    if not isinstance(found, dict):
        raise ConfigError(f"{where} returned {type(found).__name__}; it must return a dict "
                          f"{form}")
    for key, value in found.items():
        if key not in kwargs:
            raise ConfigError(f"{where} names {key!r}, which is not among the step's keyword "
                              f"inputs ({', '.join(map(repr, kwargs)) or 'none'}); return only "
                              f"keys of the dict it is given")
        problem = bad(key, value)
        if problem is not None:
            raise ConfigError(f"{where} {problem}")
    return found


def kwargs_samples(model, kwargs: dict) -> dict:
    """``{key: samples}``: for keyword inputs whose dim-0 rows belong to the batch's samples
    unevenly (images of a vision-language model: 0..n per sample, and their patches), the
    sample of each row - a 1-D int64 tensor, non-decreasing, one entry per row - as the model
    declares it in ``get_pipeline_kwargs_samples(kwargs)``. Such a tensor is cut by sample,
    never by position: microbatch ``k`` gets the rows of its own samples (an empty view when
    they hold none), and a data-parallel rank the rows of its share. ``{}`` when the model has
    no such method.

    :raises ConfigError: the method names a key ``kwargs`` does not hold, or gives a sample
        list that is not a non-decreasing 1-D integer tensor of sample indices.
    """
    def bad_samples(key, samples):
        if not isinstance(samples, torch.Tensor) or samples.dim() != 1 or \
                samples.is_floating_point() or bool((samples.diff() < 0).any()):
            return (f"gives {key!r} {type(samples).__name__} samples; give a 1-D integer "
                    f"tensor, one non-decreasing sample index per row")
        return None

    return _answer(model, "get_pipeline_kwargs_samples", kwargs, "{keyword: sample of each row}",
                   bad_samples)


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
