"""Short-lived local helper processes for measuring: :func:`run_helpers`.

The launcher measures before any rank exists (the link between two processes,
:mod:`pp_core.measure.link`; a tensor-parallel stage, whose collectives need all its tp ranks),
so it starts a few spawned processes that rendezvous among themselves and end when done. Whatever
ends the wait - Ctrl-C, SIGTERM, a helper that died - ends every helper too, within a couple of
seconds: none outlives the caller, and a helper's failure is one :class:`PipelineError`.
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

import torch.multiprocessing as mp

from pp_core.errors import PipelineError

__all__ = ["run_helpers", "HELPER_TIMEOUT_S"]

HELPER_TIMEOUT_S = 120
"""The longest a measuring helper waits for its peers (a measurement takes seconds)."""


def run_helpers(worker: Callable, args: tuple, nprocs: int, *, died: str, failed: str,
                start_method: str = "spawn") -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    :param died: the error's text when a helper ended before it finished; ``{}`` in it is
        replaced by how it ended.
    :param failed: the error's text when a helper raised (its last line follows).
    :param start_method: ``"forkserver"`` forks the helpers from a fork server the caller
        started (torch imported there once); such a helper does not inherit this process's
        ignored SIGINT, so ``worker`` ignores it first thing itself.
    """
    # started ignoring SIGINT (an ignored signal stays ignored across exec, and Python then
    # installs no KeyboardInterrupt handler): a Ctrl-C in the terminal reaches the helpers too,
    # and one importing torch printed its traceback; the caller's KeyboardInterrupt ends them
    # below. This process blocks SIGINT meanwhile, so a Ctrl-C in that instant arrives after.
    main = threading.current_thread() is threading.main_thread()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, daemon=True,
                                     start_method=start_method)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        while not context.join(timeout=0.2):
            pass
    except mp.ProcessExitedException as exc:
        raise PipelineError(died.replace("{}", str(exc))) from None
    except mp.ProcessRaisedException as exc:
        raise PipelineError(f"{failed}: {str(exc).strip().splitlines()[-1][:300]}") from None
    finally:
        _stop(context.processes)


def _stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
