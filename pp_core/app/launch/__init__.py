"""Start the ranks of a pipeline through torch's own launcher (the API behind ``torchrun``).

``pp-core run`` on one machine starts ``spec.dims.world_size`` processes (``pp_size *
dp_replicate * dp_shard * tp_size``: :class:`~pp_core.parallel.dims.ParallelDims`) with
:func:`torch.distributed.launcher.api.elastic_launch` (the torchelastic agent, c10d rendezvous),
listening on loopback (``127.0.0.1``) with a free port unless the YAML names an address. On
several machines every node runs the same command with ``distributed.nnodes`` and a reachable
``master_addr``/``master_port`` (or ``rdzv_endpoint``); or ``torchrun`` starts the processes and
each one runs ``pp-core run`` as a single rank (detected by ``RANK``/``WORLD_SIZE``).

A rank that raises or dies makes the agent stop the others; with ``distributed.max_restarts: N``
the agent starts every rank again, up to N times (each restarted rank resumes from the latest
complete checkpoint by itself: :mod:`pp_core.app.restarts`, which works the same under
``torchrun --max-restarts``). With ``distributed.nnodes: "MIN:MAX"`` the agent's c10d rendezvous
re-forms the group with the nodes still there (``min_nodes``/``max_nodes``), and each rank fits
the run to the world it was given (:mod:`pp_core.app.elastic`, in :func:`rank_main`). A failure
beyond that makes :func:`launch` raise :class:`~pp_core.PipelineError` with that rank's error
(and traceback, unless pp-core raised it) and the restarts used, instead of hanging. Before
any process starts, the device (:mod:`pp_core.devices`), the rendezvous endpoint
(:mod:`pp_core.app.rendezvous`) and ``$PP_CORE_TIMEOUT`` are checked; torch's launcher files go
to a temp dir removed afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
from typing import Any, Callable

from pp_core.app.elastic import fit_world
from pp_core.app.logs import configure_logging
from pp_core.app.launch.decide import decide
from pp_core.app.launch.warm import adopt, snapshot
from pp_core.app.interrupts import interrupt_once, signals_raise
from pp_core.app.machine import MachineShare
from pp_core.app.rendezvous import prepare_endpoint, started_by_torchrun
from pp_core.app.restarts import launch_clock, restarts_used
from pp_core.app.spec import Spec
from pp_core.app.spec.sections import DistributedSpec
from pp_core.errors import ConfigError, PPCoreError, PipelineError

__all__ = ["launch", "started_by_torchrun", "rank_main", "is_loopback"]

SHUTDOWN_TIMEOUT_S = 5
"""Seconds a rank gets to exit after a failure (the agent's stop, and torch.multiprocessing's
after a rank failed: :func:`~pp_core._torch_compat.failed_ranks_stopped_within`) before SIGKILL
(a stopped rank never exits)."""

ELASTIC_KEEP_ALIVE = {"keep_alive_interval": 1, "keep_alive_max_attempt": 5}
"""The c10d rendezvous of an elastic run (``nnodes: "MIN:MAX"``): a node whose agent sent no
heartbeat for 5 s is dead (torch's default is 15 s), so the survivors of a lost node go on
after that and ``distributed.elastic_wait_s`` (torch's ``last_call_timeout``)."""


def is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def rank_main(spec_values: dict, entrypoint: Callable | None = None,
              source: str = "pipeline", launcher: tuple | None = None) -> Any:
    """What every rank runs: rebuild the :class:`Spec` from :meth:`Spec.to_dict` and train (or
    call ``entrypoint(spec)``). ``launcher``: the launcher's environment and ``sys.path``, for a
    rank forked warm (:mod:`pp_core.app.launch.warm`)."""
    if launcher is not None:
        adopt(launcher)
    configure_logging(f"pp-core rank {os.environ.get('RANK', '0')}")
    interrupt_once()
    # the launcher reports a failed step once, as the run's error (not once per rank)
    logging.getLogger("pp_core.runtime.failures").setLevel(logging.CRITICAL)
    spec, refitted = fit_world(Spec.from_dict(spec_values, source))  # nnodes: "MIN:MAX"
    if refitted and os.environ.get("RANK", "0") == "0":
        print(refitted, flush=True)
    if entrypoint is not None:
        return entrypoint(spec)
    from pp_core.app.rank import train  # lazy: torch, only the ranks need it

    try:
        return train(spec)
    except RuntimeError as exc:
        if any(words in str(exc) for words in LOST_PEER):
            # a peer died first: let torch's agent see its death before this knock-on error,
            # so the run names the cause (a forked rank's death reaches the agent through the
            # fork server, a little after a peer's raise); the agent stops this rank meanwhile
            time.sleep(LOST_PEER_GRACE_S)
        raise


LOST_PEER = ("Connection closed by peer", "Connection reset by peer")
"""gloo's words for a collective whose peer process is gone."""
LOST_PEER_GRACE_S = 2.0


@contextlib.contextmanager
def _loopback_gloo(enabled: bool):
    """Workers inherit ``GLOO_SOCKET_IFNAME=lo`` (gloo's sockets on loopback) unless it is set."""
    if not enabled or "GLOO_SOCKET_IFNAME" in os.environ or not _has_interface("lo"):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _has_interface(name: str) -> bool:
    try:
        return name in {n for _, n in socket.if_nameindex()}
    except (OSError, AttributeError):  # platforms without if_nameindex
        return False


def launch(spec: Spec, entrypoint: Callable | None = None,
           announce: Callable[[str], None] | None = None,
           memory_cap: int | None = None, warm: bool = False) -> dict[int, Any]:
    """Run the pipeline on this machine's ranks; returns each local rank's return value.

    :param entrypoint: a picklable ``entrypoint(spec)`` to run on every rank instead of
        :func:`pp_core.app.rank.train` (tests use it to inspect a rank from inside).
    :param announce: called with one line (ranks, device and why) once every check passed,
        just before the processes start.
    :param memory_cap: bytes per rank for ``pipeline.pp_schedule: auto`` (planned here, once).
    :param warm: fork the ranks from the fork server :func:`pp_core.app.launch.warm.start` began
        (imports done), instead of spawning them.
    When this process is itself a rank (started by torchrun), it just runs that rank.
    """
    from pp_core.runtime.group import resolve_timeout  # lazy: torch, once launching

    resolve_timeout(None)  # a bad $PP_CORE_TIMEOUT fails here, not in every rank
    layout = MachineShare.of(spec)
    if started_by_torchrun():
        spec = decide(spec, layout)  # refuses what only a launching process can measure
        dims = spec.dims
        mismatch = dims.world_size_problem(int(os.environ["WORLD_SIZE"]),
                                           "torchrun started {} ranks")
        if mismatch and not spec.distributed.elastic:  # an elastic run fits itself: rank_main
            raise ConfigError(f"{mismatch}; pass --nnodes/--nproc-per-node that multiply to "
                              f"{dims.world_size}")
        return {int(os.environ.get("LOCAL_RANK", 0)): rank_main(spec.to_dict(), entrypoint,
                                                               spec.source)}
    dist = spec.distributed
    with _signals_raise():  # SIGTERM during the checks or the rendezvous ends us cleanly too
        spec = decide(spec, layout, announce=announce, memory_cap=memory_cap)
        endpoint = prepare_endpoint(dist)
        if announce is not None:
            node = f", node of {dist.nnodes}" if dist.max_nodes > 1 else ""
            announce(f"starting {layout.local_ranks} rank(s) on this machine "
                     f"({spec.dims.describe()}{node}) on {layout.device} ({layout.reason})")
        with _launch_temp_dir() as logs:
            return _elastic_launch(spec, entrypoint, layout.local_ranks, endpoint, logs, warm)


@contextlib.contextmanager
def _launch_temp_dir():
    """One temporary directory for what torch's launcher leaves behind, removed afterwards.

    The agent makes a ``torchelastic_*`` log directory per run and ``torch.multiprocessing``
    a ``pytorch-errorfile-*`` per failed rank, in the temp dir, and never removes them; so while
    the ranks run, this process's temp dir is this one (the ranks' own is unchanged).
    """
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="pp-core-launch-") as path:
        tempfile.tempdir = path
        try:
            yield path
        finally:
            tempfile.tempdir = previous


def _elastic_launch(spec: Spec, entrypoint, nproc: int, endpoint, log_dir: str, warm: bool):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # lazy: torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pp_core._torch_compat import failed_ranks_stopped_within, \
        tcp_stores_listening_on_their_host

    dist = spec.distributed
    host = endpoint.host
    if dist.rdzv_backend == "static":
        rdzv_configs: dict[str, Any] = {"timeout": dist.timeout_s,
                                        "rank": dist.node_rank or 0}
    else:  # the c10d handler reads join_timeout (not timeout); is_host: we know, torch guesses
        rdzv_configs = {"join_timeout": dist.timeout_s, "is_host": endpoint.is_host}
        if dist.elastic:
            rdzv_configs.update(ELASTIC_KEEP_ALIVE, last_call_timeout=dist.elastic_wait_s)
    config = LaunchConfig(
        min_nodes=dist.min_nodes, max_nodes=dist.max_nodes, nproc_per_node=nproc,
        run_id=dist.rdzv_id, rdzv_backend=dist.rdzv_backend, rdzv_endpoint=str(endpoint),
        rdzv_configs=rdzv_configs, max_restarts=dist.max_restarts, monitor_interval=0.1,
        start_method="forkserver" if warm else "spawn",
        local_addr=host if is_loopback(host) else None,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),  # not a /tmp/torchelastic_* per run
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    # we report a failed rank ourselves, once, below
    quiet = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
             if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]
    previous = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    listeners = tcp_stores_listening_on_their_host(is_loopback) if is_loopback(host) else \
        contextlib.nullcontext()  # else torch's TCPStore servers listen on every interface
    try:
        with listeners, _loopback_gloo(is_loopback(host)), launch_clock(dist.max_restarts), \
                failed_ranks_stopped_within(SHUTDOWN_TIMEOUT_S):
            return elastic_launch(config, rank_main)(spec.to_dict(), entrypoint, spec.source,
                                                     snapshot() if warm else None)
    except ChildFailedError as exc:
        raise PipelineError(_failure_message(exc) + restarts_used(dist.max_restarts)) from None
    except RendezvousError as exc:
        raise PipelineError(_rendezvous_message(exc, endpoint, dist)) from None
    finally:
        for logger, level in zip(quiet, previous):
            logger.setLevel(level)


def _rendezvous_message(exc, endpoint, dist: DistributedSpec) -> str:
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError  # lazy: torch

    keys = endpoint.address_key if endpoint.address_key == endpoint.port_key else \
        f"{endpoint.address_key}/{endpoint.port_key}"
    if isinstance(exc, RendezvousTimeoutError):
        return (f"the rendezvous at {endpoint} did not complete within distributed.timeout_s = "
                f"{dist.timeout_s} s: expected {dist.nnodes} nodes; start pp-core run (or "
                f"torchrun) on every node with the same {keys} and distributed.rdzv_id, or "
                f"raise distributed.timeout_s")
    cause = exc.__cause__ or exc.__context__
    detail = str(cause).splitlines()[0] if cause is not None and str(cause) else str(exc)
    return f"the rendezvous at {endpoint} failed ({detail}); check {keys}"


@contextlib.contextmanager
def _signals_raise():
    """Make SIGTERM, SIGHUP and SIGQUIT raise ``SignalException`` (as torch's agent does while the
    ranks run) so that cleanup runs and ``pp-core run`` exits 128 + the signal's number; every
    handler (SIGINT too, which the agent replaces and never restores) is put back afterwards."""
    from torch.distributed.elastic.multiprocessing import SignalException  # lazy: torch

    with signals_raise(lambda sigval: SignalException(f"pp-core got {sigval.name}",
                                                      sigval=sigval)):
        yield


def _failure_message(exc) -> str:
    """The first failed rank's error, and its traceback unless pp-core raised it (the others
    were stopped because of it)."""
    rank, failure = exc.get_first_failure()
    data = failure.error_file_data or {}
    recorded = data.get("message") if isinstance(data, dict) else None
    trace = ""
    if isinstance(recorded, dict):
        message = recorded.get("message", "")
        trace = (recorded.get("extraInfo") or {}).get("py_callstack", "")
    elif isinstance(recorded, str) and recorded not in ("", "<NONE>", "<N/A>"):
        message = recorded
    else:  # no error file: the process died without raising (os._exit, a signal, OOM killer)
        message = f"the process exited with code {failure.exitcode}"
        if failure.exitcode is not None and failure.exitcode < 0:
            message += f" (killed by {failure.signal_name()})"
    others = len(exc.failures) - 1
    also = f"; {others} other rank(s) failed too" if others > 0 else \
        "; the other ranks were stopped"
    text = f"rank {rank} failed: {message}{also}"
    if trace and not _own_error(message, trace):  # pp-core's own messages say all; no traceback
        text += "\n" + trace.rstrip()
    return text


def _own_error(message: str, trace: str = "") -> bool:
    """Whether a rank's recorded ``"Type: text"`` is one of pp-core's error types: one this
    process has loaded, or - named in the traceback's last line (``pp_core.app.rank.health.
    NonFiniteStep: ...``) - one from a module only the ranks import (the NaN stop's)."""
    def names(cls):
        yield cls.__name__
        for sub in cls.__subclasses__():
            yield from names(sub)

    if message.split(":", 1)[0] in set(names(PPCoreError)):
        return True
    lines = trace.rstrip().splitlines()
    module, _, name = (lines[-1].split(":", 1)[0] if lines else "").rpartition(".")
    if not module.startswith("pp_core.") or name != message.split(":", 1)[0]:
        return False
    import importlib  # lazy: only for a rank's error from a module this process never loaded

    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - a module that cannot load here: show the traceback
        return False
    return isinstance(found, type) and issubclass(found, PPCoreError)
