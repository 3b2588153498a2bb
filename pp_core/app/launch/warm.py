"""Ranks forked warm: torch and the trainer imported while the launching process checks the file.

A rank started with ``spawn`` is a fresh interpreter that imports torch, its dynamo (torch
imports it for every optimizer it builds) and the trainer before it can train: seconds of a
core, which the launching process spends checking the pipeline file first, one after the other.
:func:`start` starts multiprocessing's fork server as soon as the file is read, importing
:data:`PRELOAD` in the background; torch's launcher then forks each rank from it, ready to
train. The fork server holds no thread and no device (importing torch starts neither), so a
fork of it is as clean as a spawn; it ends with the launching process.

A forked rank has the environment and ``sys.path`` the fork server started with, not those of
the launcher at launch time (its checks may have set variables since, such as which
checkpoints it verified): :func:`adopt` brings a rank up to date, keeping the variables torch's
agent set for that rank.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys

from pp_core._torch_compat import DYNAMO_MODULE

__all__ = ["PRELOAD", "start", "snapshot", "adopt"]

PRELOAD = ["pp_core.app.launch.warm", "torch", DYNAMO_MODULE, "pp_core.app.rank"]
"""What the fork server imports before it forks the first rank (this module first: see
:data:`STARTED_WITH`)."""

STARTED_WITH = dict(os.environ)
"""In the fork server and the ranks forked from it: the environment the server started with."""


def start() -> bool:
    """Start the fork server, importing :data:`PRELOAD`, and return at once; ``False`` where the
    platform has no fork server (the ranks are then spawned)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    return True


def snapshot() -> tuple[dict[str, str], list[str]]:
    """This process's environment and ``sys.path`` now, for :func:`adopt` in each rank."""
    return dict(os.environ), list(sys.path)


def adopt(launcher: tuple[dict[str, str], list[str]]) -> None:
    """In a rank forked from the server: each variable the launcher set, changed or removed since
    the server started as the launcher has it now (the ones torch's agent set for this rank are
    not the launcher's, so they stay), and the launcher's ``sys.path``."""
    environment, path = launcher
    for key in set(STARTED_WITH) | set(environment):
        now = environment.get(key)
        if now != STARTED_WITH.get(key):
            if now is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = now
    sys.path[:] = path
