"""What a split backward's ``I`` leaves alive for its ``W``, per unit (the profiler measures it).

Why: between a stage-microbatch's ``I`` and its ``W`` the runtime holds more than the saved
activations. :func:`pp_core.runtime.backward.backward_input` keeps the gradient that reaches
every boundary node (where a parameter's side branches off the input path) for ``W`` to restart
from: per transformer block the gradients into its attention and MLP projections, about 0.6x
the block's saved bytes, and a view of the gradient of the unit's output (the last projection's
weight side needs it). A memory model that frees nothing at ``I`` and everything at ``W``
under-predicted split-backward plans by up to 1.37x.

How: an allocation log (:class:`~pp_core.measure.transient.Allocations`) of the unit's forward
(:meth:`HeldForWeight.hooks`) and its ``I``; the caller then drops its outputs, as the
runtime does (it pops them for ``I``). Before the first ``W`` of the microbatch:

* ``held``: what ``I`` allocated that is still alive, less the input gradients it returned
  (the previous unit's ``received``; at a stage's start it is sent away and is the receive
  buffer of the previous stage);
* ``freed``: what of the forward's storages is gone since ``I`` began. ``I`` retains the graph,
  but once the outputs are dropped only ``W``'s roots hold it, so the nodes above the unit's
  topmost boundary die with their saved tensors (a head's log-softmax). Inside a stage of
  several units that happens only in its last unit (the next unit's graph holds the rest);
* ``received``: how many bytes of the gradient the unit was given are still alive: only its
  own ``W`` state holds them.
"""

from __future__ import annotations

import weakref

from pp_core.measure.transient import Allocations, storages

__all__ = ["HeldForWeight"]


class HeldForWeight:
    """One unit, one microbatch: wrap its ``I`` in :meth:`input_pass`, call :meth:`measure`
    before any ``W`` runs."""

    def __init__(self):
        self.log = Allocations()
        self.window = (0, 0)
        self.returned: set[int] = set()   # allocation ids of the input gradients handed back
        self.received: list = []          # (weak reference to a storage, its bytes)
        self.held = self.freed = self.received_held = 0

    def hooks(self):
        """What the profiler enters around the unit's forward: the log alone. (Not the
        ``saved_tensors_hooks`` that count saved bytes: a saved output packed as a Python tensor
        holds its own node, so nothing above the boundary would die at ``I``.)"""
        return self.log.tracking()

    def input_pass(self, run, received):
        """``run()`` (the unit's ``backward_input``) logged; ``received`` are the gradients it
        was given (``None`` on the last unit)."""
        start = len(self.log.events)
        with self.log.tracking():
            returned, state = run()
        self.window = (start, len(self.log.events))
        self.returned = {self.log.live[s.data_ptr()] for s in storages(returned)
                         if s.data_ptr() in self.log.live}
        seen = {}
        for storage in storages(received or ()):
            seen.setdefault(storage.data_ptr(), storage)
        self.received = [(weakref.ref(s), s.nbytes()) for s in seen.values()]
        return returned, state

    def measure(self) -> tuple[int, int, int]:
        """``(held, freed, received)`` now; see the module docstring."""
        start, end = self.window
        alive = set(self.log.live.values())
        size, before = {}, set()
        for index, (ident, delta) in enumerate(self.log.events[:end]):
            if delta > 0:
                size[ident] = delta
                if index < start:
                    before.add(ident)
        made = {ident for ident, delta in self.log.events[start:end] if delta > 0}
        self.held = sum(size[i] for i in made & alive if i not in self.returned)
        self.freed = sum(-delta for ident, delta in self.log.events[start:]
                         if delta < 0 and ident in before)
        self.received_held = sum(n for ref, n in self.received if ref() is not None)
        return self.held, self.freed, self.received_held
