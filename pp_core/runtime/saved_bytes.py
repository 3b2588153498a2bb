"""``peak_saved_bytes``: the most bytes autograd held saved for backward at once during a step.

Measured, not predicted: while a training step runs, ``torch.autograd.graph.saved_tensors_hooks``
sees every tensor autograd saves (its pack hook) and the handle it returns lives exactly as long
as autograd keeps the tensor (the graph frees it after the backward that used it). Bytes are
counted per storage, once however many views of it are saved, and parameters are left out (they
are held anyway): what remains is the activation memory a schedule, sequence slices
(``pp_seq_chunks``) or activation checkpointing change.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["SavedBytes"]


def _pointer(tensor):
    """The data pointer of ``tensor``'s storage, or ``None`` where it has none to give."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Held:
    """A saved tensor's handle; dropping it (the graph freed it) gives its bytes back.

    It keeps the tensor *detached*: a saved output's ``grad_fn`` is the node that saves it, so
    holding the tensor itself would make a reference cycle (node -> handle -> tensor -> node)
    that keeps the graph, and through its AccumulateGrad nodes the parameters, alive until the
    cycle collector runs. Autograd restores the history itself when it unpacks."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor.detach(), key, meter

    def __del__(self):
        if getattr(self, "key", None) is not None:  # None too if __init__ never finished
            self.meter._release(self.key)


class SavedBytes:
    """Counts what autograd holds saved while :meth:`measuring`; ``peak`` is the last step's."""

    def __init__(self):
        self.peak = 0
        self._live = 0
        self._refs: dict = {}  # storage pointer -> [saved handles, bytes]
        self._skip: set = set()  # the parameters' storages

    def _pack(self, tensor):
        if tensor.is_meta:
            return _Held(tensor, None, self)
        key = _pointer(tensor)
        if key is None:  # a tensor subclass without one (DTensor, FSDP's), or freed storage
            return _Held(tensor, None, self)
        storage = tensor.untyped_storage()
        if key in self._skip or key == 0:
            return _Held(tensor, None, self)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self._live += storage.nbytes()
            self.peak = max(self.peak, self._live)
        else:
            entry[0] += 1
        return _Held(tensor, key, self)

    def _release(self, key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self._live -= entry[1]

    @contextlib.contextmanager
    def measuring(self, parameters):
        """Measure one step; ``parameters``: the model's, whose storages are not counted."""
        self.peak = self._live = 0
        self._refs.clear()
        self._skip = {_pointer(p) for p in parameters if not p.is_meta} - {None}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor):
            yield self
