"""The transient peak of a unit: bytes of the tensors its forward and backward create, at most.

Why: the planner's memory prediction counts what outlives an action (parameters, gradients,
optimizer state, saved activations, receive buffers), but an action also holds temporaries while
it runs. A vocabulary head's forward and backward hold the logits, their log-softmax and both of
their gradients at once: several times the head's saved bytes, and on the head's rank more than
everything else the prediction adds up for small models (docs/benchmarks.md, planner section).

How: a dispatch mode (:data:`pp_core._torch_compat.TorchDispatchMode`) is entered around each of
the unit's forward and backward calls; every storage an op returns that none of its inputs had
is one allocation, counted once, and a finalizer on the storage object (torch keeps one Python
object per storage) marks it freed. Events are logged in order, so the peak can be replayed
afterwards without the allocations that are parameter gradients (the prediction charges those
as ``grads``). Storages that existed before (parameters, the unit's inputs) are never counted.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref

import torch

from pp_core._torch_compat import TorchDispatchMode
from pp_core.runtime.microbatch import iter_tensors

__all__ = ["Allocations", "storages", "local_tensor"]


def local_tensor(tensor):
    """What this process holds of ``tensor``: a DTensor's local shard (tensor parallelism),
    any other tensor itself. (No DTensor exists unless its module was imported.)"""
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        with torch.no_grad():  # the local tensor itself, no autograd node
            return tensor.to_local()
    return tensor


def storages(values):
    """The plain storages of the tensors in ``values`` (nested containers walked; a DTensor's
    local shard)."""
    out = []
    for value in iter_tensors(values):
        try:
            storage = local_tensor(value).untyped_storage()
            storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, a
            continue  # wrapper such as a collective's result: its tensor inside is seen)
        out.append(storage)
    return out


class Allocations:
    """The allocation log of one unit over any number of :meth:`tracking` windows."""

    def __init__(self):
        self.events: list[tuple[int, int]] = []   # (allocation id, +bytes or -bytes), in order
        self.live: dict[int, int] = {}             # data_ptr -> allocation id, while alive
        self._ids = itertools.count()

    def tracking(self):
        """A context manager: count what the ops run inside it allocate (a no-op without the
        dispatch mode)."""
        if TorchDispatchMode is None:  # pragma: no cover - a torch without it
            return contextlib.nullcontext()
        return _Mode(self)

    def _allocated(self, storage) -> None:
        nbytes, ptr = storage.nbytes(), storage.data_ptr()
        if not nbytes or not ptr or ptr in self.live:
            return
        ident = next(self._ids)
        self.live[ptr] = ident
        self.events.append((ident, nbytes))
        weakref.finalize(storage, self._freed, ptr, ident, nbytes)

    def _freed(self, ptr: int, ident: int, nbytes: int) -> None:
        if self.live.get(ptr) == ident:
            del self.live[ptr]
        self.events.append((ident, -nbytes))

    def peak(self, exclude_tensors=()) -> int:
        """The most bytes live at once, leaving out the allocations that are (still) the
        storages of ``exclude_tensors`` (the parameter gradients)."""
        skip = {self.live[s.data_ptr()] for s in storages(list(exclude_tensors))
                if s.data_ptr() in self.live}
        live = peak = 0
        for ident, delta in self.events:
            if ident not in skip:
                live += delta
                peak = max(peak, live)
        return peak


if TorchDispatchMode is not None:
    class _Mode(TorchDispatchMode):
        def __init__(self, log: Allocations):
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = {s.data_ptr() for s in storages((args, kwargs))}
            out = func(*args, **(kwargs or {}))
            for storage in storages(out):
                if storage.data_ptr() not in before:
                    self.log._allocated(storage)
            return out
