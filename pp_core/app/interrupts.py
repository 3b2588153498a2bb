"""How a command ends on a signal: promptly, having cleaned up, with the shell's exit code.

SIGTERM, SIGHUP and SIGQUIT raise (as Ctrl-C raises ``KeyboardInterrupt``) while a command runs,
so every ``finally`` on the way out runs - a measuring helper process stopped, the ranks stopped,
a temporary directory removed - where the default action would kill the process on the spot and
leave its children running. The command then exits ``128 + the signal's number`` (130 for
Ctrl-C, 143 for SIGTERM), what a shell reports for a process the signal ended. Torch-free: every
command, the schedule commands too, goes through it (:func:`pp_core.app.cli.main`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable

__all__ = ["Interrupted", "signals_raise", "exit_code", "interrupt_once", "RAISING"]

RAISING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT")
                if hasattr(signal, name))
"""The signals that raise; SIGINT raises ``KeyboardInterrupt`` already."""


class Interrupted(BaseException):
    """A signal ended the command (a ``BaseException``, as ``KeyboardInterrupt`` is: no
    ``except Exception`` on the way out swallows it)."""

    def __init__(self, sigval: signal.Signals):
        super().__init__(f"pp-core got {sigval.name}")
        self.sigval = sigval


@contextlib.contextmanager
def signals_raise(make: Callable[[signal.Signals], BaseException] = Interrupted):
    """While inside, :data:`RAISING` signals raise ``make(signal)``; every handler (SIGINT's
    too, which torch's launcher replaces and never restores) is put back afterwards. Outside the
    main thread (no handler can be set there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_signal(signum, frame):
        raise make(signal.Signals(signum))

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *RAISING)}
    for sig in RAISING:
        signal.signal(sig, raise_signal)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def exit_code(exc: BaseException) -> tuple[signal.Signals, int]:
    """The signal an interruption stands for (``KeyboardInterrupt``: SIGINT; an exception with
    a ``sigval``, :class:`Interrupted` or torch's ``SignalException``: that one) and the exit
    code for it."""
    sigval = getattr(exc, "sigval", None) or signal.SIGINT
    return sigval, 128 + int(sigval)


def interrupt_once() -> None:
    """A rank's Ctrl-C: the first SIGINT raises ``KeyboardInterrupt``, later ones are ignored.
    A terminal's Ctrl-C reaches every rank, and torch's launcher then sends each one SIGINT
    again; that second one landed in the rank's exit (its atexit callbacks) and printed a
    traceback per rank under pp-core's one line."""
    if threading.current_thread() is not threading.main_thread():
        return

    def first(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, first)
