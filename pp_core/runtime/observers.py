"""The executor's public per-action seam: observers called around every action of a step.

Anything that wants to see a pipeline's actions as they run - a timer, a tracer, a counter -
registers an :class:`ActionObserver` with ``pipe.add_action_observer(observer)`` instead of
wrapping the executor's internals. For every action of every later step (training and
evaluation) the executor calls, on this rank:

* ``on_action_start(action)`` right before the action runs and ``on_action_end(action)`` right
  after it finished (not when it raised: the step then fails with a ``PipelineError``);
* ``on_wait_start(action)`` / ``on_wait_end(action)`` around each blocking wait for a peer's
  message inside a compute action (so ``end - start - waits`` is the action's own time), and
  with ``action=None`` around the end-of-step wait for this rank's sends to complete.

``action`` is a :class:`pp_core.schedule.ir.Action`. Observers run in registration order at the
start and in reverse order at the end, on the host, without synchronising a device: an observer
that times CUDA work synchronises itself. With no observer registered the executor calls none of
this (one list check per action).

Independently of observers, every action runs inside ``torch.profiler.record_function`` while a
torch profiler is recording, named ``PP:<action>`` (:func:`pp_core.schedule.labels.
profiler_label`), so a profiler trace shows pipeline actions next to the kernels they launched.
Whether a profiler records is checked once per step; with none, the cost is that one check.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from pp_core.schedule.labels import profiler_label

__all__ = ["ActionObserver", "ActionTrace", "run_action", "waiting"]


class ActionObserver:
    """Base class with do-nothing callbacks: override the ones you need."""

    def on_action_start(self, action) -> None:
        pass

    def on_action_end(self, action) -> None:
        pass

    def on_wait_start(self, action) -> None:
        pass

    def on_wait_end(self, action) -> None:
        pass


class ActionTrace(ActionObserver):
    """``(label, start, end)`` per action of a step (``perf_counter`` seconds), and
    ``("wait_sends", start, end)`` for the end-of-step wait: what ``Pipeline.tracing`` keeps."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []
        self._start = 0.0

    def on_action_start(self, action) -> None:
        self._start = time.perf_counter()

    def on_action_end(self, action) -> None:
        self.events.append((str(action), self._start, time.perf_counter()))

    def on_wait_start(self, action) -> None:
        if action is None:
            self._start = time.perf_counter()

    def on_wait_end(self, action) -> None:
        if action is None:
            self.events.append(("wait_sends", self._start, time.perf_counter()))


def run_action(handler, executor, state, action, observers, profiled: bool) -> None:
    """Run ``handler(executor, state, action)`` under the observers and, when ``profiled``, a
    profiler record."""
    for observer in observers:
        observer.on_action_start(action)
    if profiled:
        with torch.profiler.record_function(profiler_label(action)):
            handler(executor, state, action)
    else:
        handler(executor, state, action)
    for observer in reversed(observers):
        observer.on_action_end(action)


def waiting(observers, action: Optional[object], wait, *args):
    """``wait(*args)`` between the observers' ``on_wait_start`` and ``on_wait_end``."""
    for observer in observers:
        observer.on_wait_start(action)
    try:
        return wait(*args)
    finally:
        for observer in reversed(observers):
            observer.on_wait_end(action)
