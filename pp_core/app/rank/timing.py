"""What a rank measures of its own training steps: each action's time and wait, the step
totals, the peak memory - the figures :class:`~pp_core.app.rank.run_outputs.RunRecorder` logs and
gathers into the summary and the trace.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from pp_core.runtime.observers import ActionObserver

__all__ = ["ActionTimer", "StepTotals", "peak_memory"]


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """``(bytes, kind)``: CUDA's max allocated, or the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda allocated"
    try:
        import resource  # lazy: POSIX only

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss * (1 if sys.platform == "darwin" else 1024), "process RSS"
    except ImportError:  # Windows
        return None, ""


class StepTotals:
    """Sums over steps of the seconds in ``Pipeline.step`` and, when actions are timed, of the
    seconds in compute actions (``busy``) and in send/receive actions (``comm``)."""

    __slots__ = ("steps", "seconds", "timed", "busy", "comm")

    def __init__(self):
        self.steps, self.seconds, self.timed, self.busy, self.comm = 0, 0.0, False, 0.0, 0.0

    def add(self, seconds: float, busy: float | None, comm: float | None) -> None:
        self.steps += 1
        self.seconds += seconds
        if busy is not None:
            self.timed = True
            self.busy += busy
            self.comm += comm


class ActionTimer(ActionObserver):
    """Times every action of the steps it observes (host clock, ``perf_counter``) through the
    executor's per-action seam; :class:`RunRecorder` registers it around training steps only
    (``pipe.add_action_observer``), so evaluations do not count. An action's *busy* time is its
    duration minus the time it waited for a peer's message. On CUDA each action is synchronised
    so the host clock measures the kernels (a small slowdown)."""

    def __init__(self, device: torch.device):
        self.records: list[tuple[Any, float, float, float]] = []
        self._start = self._wait = self._wait_start = 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None

    def on_action_start(self, action) -> None:
        self._wait = 0.0
        self._start = time.perf_counter()

    def on_wait_start(self, action) -> None:
        self._wait_start = time.perf_counter()

    def on_wait_end(self, action) -> None:
        if action is not None:  # not the end-of-step wait for sends
            self._wait += time.perf_counter() - self._wait_start

    def on_action_end(self, action) -> None:
        if self._sync is not None:
            self._sync()
        self.records.append((action, self._start, time.perf_counter(), self._wait))

    def take(self) -> list[tuple[Any, float, float, float]]:
        """This step's ``(action, start, end, wait)`` records, and forget them."""
        records, self.records = self.records, []
        return records
