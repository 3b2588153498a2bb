"""Run test functions on N local gloo ranks: the processes are spawned once, many cases inside.

For plugin authors and pp-core's own tests (``from pp_core.testing import DistPool``): test a
schedule, splitter or initializer end to end on real ranks in a few lines::

    pool = DistPool(2)                      # two ranks, one gloo process group
    results = pool.run(check_1f1b, 4)       # check_1f1b(4) on every rank; its returns, by rank
    outcomes = pool.run_outcomes(fails)     # per-rank Outcome(ok, value, error, message)
    pool.close()

``fn`` must be importable by name (a module-level function of the test module). Each rank runs
with ``torch.set_num_threads(1)`` and a default process group over a ``FileStore`` (no ports).
When a case leaves a rank with an error or without its process group (a failing pipeline
destroys its group on purpose), every rank gets a fresh group before the next case. A case that
does not finish within ``timeout`` seconds kills the pool (a hang is a test failure, never a
stuck suite); the next case starts a new one. ``timeout`` counts from the moment every rank has
started the case: starting the processes (importing torch) and the process group is bounded by
``startup_timeout`` instead - on a loaded machine (``pytest -n 12``, dozens of ranks importing
torch at once) a cold start alone can take longer than a case may, and was reported as a hang.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistPool", "Outcome", "RankError"]


class Outcome(NamedTuple):
    ok: bool
    value: Any
    error: str  # exception type name ("" when ok)
    message: str  # str(exception) ("" when ok)
    traceback: str


class RankError(AssertionError):
    """One or more ranks raised; the message holds every failing rank's traceback."""


def _worker(rank: int, world_size: int, tasks, results) -> None:
    torch.set_num_threads(1)
    generation = None
    while True:
        task = tasks.get()
        if task is None:
            break
        gen, store_path, fn, args, kwargs = task
        try:
            if generation != gen or not dist.is_initialized():
                if dist.is_initialized():
                    dist.destroy_process_group()
                dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                        world_size=world_size)
                generation = gen
            results.put((rank, None, True))  # started: the case's own timeout runs from here
            value = fn(*args, **kwargs)
            outcome = Outcome(True, value, "", "", "")
        except BaseException as exc:  # report everything, keep serving
            outcome = Outcome(False, None, type(exc).__name__, str(exc), traceback.format_exc())
        healthy = dist.is_initialized()
        results.put((rank, _sendable(outcome), healthy))
    if dist.is_initialized():
        dist.destroy_process_group()


def _sendable(outcome: Outcome) -> Outcome:
    """``outcome``, or an error outcome when it cannot be pickled (a tensor that requires grad,
    a lambda). The queue pickles in a background thread that only prints such an error, so the
    test process would wait for this rank's result until the case's timeout: a fake hang."""
    try:
        ForkingPickler.dumps(outcome)  # with torch's reductions, as the queue will
        return outcome
    except Exception as exc:
        return Outcome(False, None, type(exc).__name__,
                       f"the case's return value cannot be sent to the test process: {exc}", "")


class DistPool:
    """``world_size`` spawned ranks sharing one gloo process group (renewed after a failure)."""

    def __init__(self, world_size: int, timeout: float = 120.0, startup_timeout: float = 600.0):
        self.world_size = world_size
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="pp_core_dist_")
        self._generation = 0
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, self._tasks[r],
                                                         self._results), daemon=True)
                       for r in range(self.world_size)]
        for proc in self._procs:
            proc.start()
        self._renew()

    def _renew(self) -> None:
        self._generation += 1
        self._store = os.path.join(self._dir, f"store{self._generation}")

    def run_outcomes(self, fn: Callable, *args, **kwargs) -> list[Outcome]:
        """Run ``fn(*args, **kwargs)`` on every rank; each rank's :class:`Outcome`, by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close(keep_dir=True)
            self._start()
        for tasks in self._tasks:
            tasks.put((self._generation, self._store, fn, args, kwargs))
        outcomes: list = [None] * self.world_size
        started: set[int] = set()
        renew = False
        deadline = time.monotonic() + self.startup_timeout

        def start(rank: int) -> float:  # the deadline once ``rank`` has started (or ended)
            if rank not in started:
                started.add(rank)
                if len(started) == self.world_size:
                    return time.monotonic() + self.timeout
            return deadline

        while any(o is None for o in outcomes):
            try:
                rank, outcome, healthy = self._results.get(timeout=0.2)
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if outcomes[rank] is None and not proc.is_alive():
                        outcomes[rank] = Outcome(False, None, "ProcessDied",
                                                 f"rank {rank} exited with code {proc.exitcode}",
                                                 "")
                        renew = True
                        deadline = start(rank)
                if time.monotonic() > deadline:
                    self.close(keep_dir=True)
                    what = (f"finish on every rank within {self.timeout} s (a hang)"
                            if len(started) == self.world_size else
                            f"start on every rank within {self.startup_timeout} s (started on "
                            f"ranks {sorted(started)}; the others were still starting their "
                            f"process or process group)")
                    raise RankError(f"{getattr(fn, '__name__', fn)} did not {what}; the pool was "
                                    f"killed") from None
                continue
            deadline = start(rank)
            if outcome is None:  # the rank has started the case (processes and group are up)
                continue
            outcomes[rank] = outcome
            renew = renew or not outcome.ok or not healthy
        if renew:
            self._renew()
        return outcomes

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """Run ``fn`` on every rank and return the values by rank; raise if any rank raised."""
        outcomes = self.run_outcomes(fn, *args, **kwargs)
        failed = [(r, o) for r, o in enumerate(outcomes) if not o.ok]
        if failed:
            text = "\n".join(f"--- rank {r}: {o.error}: {o.message}\n{o.traceback}"
                             for r, o in failed)
            raise RankError(f"{getattr(fn, '__name__', fn)} failed on rank(s) "
                            f"{[r for r, _ in failed]}:\n{text}")
        return [o.value for o in outcomes]

    def close(self, keep_dir: bool = False) -> None:
        started = [proc for proc in self._procs if proc.pid is not None]  # a start can fail
        for tasks, proc in zip(getattr(self, "_tasks", []), self._procs):
            if proc.pid is not None and proc.is_alive():
                try:
                    tasks.put(None)
                except Exception:
                    pass
        for proc in started:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        if not keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
