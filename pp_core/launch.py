"""Start the ranks of a pipeline through torch's own launcher (the API behind ``torchrun``).

``pp-core run`` on one machine starts ``pp_size * dp_size`` processes with
:func:`torch.distributed.launcher.api.elastic_launch` (the torchelastic agent, c10d rendezvous),
listening on loopback (``127.0.0.1``) with a free port unless the YAML names an address. On
several machines every node runs the same command with ``distributed.nnodes`` and a reachable
``master_addr``/``master_port`` (or ``rdzv_endpoint``); or ``torchrun`` starts the processes and
each one runs ``pp-core run`` as a single rank (detected by ``RANK``/``WORLD_SIZE``).

A rank that raises or dies makes the agent stop the others (``max_restarts=0``), and
:func:`launch` raises :class:`~pp_core.PipelineError` with that rank's error and traceback
instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Callable

from pp_core.errors import ConfigError, PipelineError
from pp_core.spec import Spec

__all__ = ["launch", "started_by_torchrun", "free_port", "rank_main", "is_loopback"]


def started_by_torchrun(environ=None) -> bool:
    """Whether this process is already one rank of a launched job (torchrun, elastic agent)."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def free_port(address: str = "127.0.0.1") -> int:
    """A port nobody listens on at ``address`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def rank_main(spec_values: dict, entrypoint: Callable | None = None) -> Any:
    """What every rank runs: rebuild the :class:`Spec` and train (or call ``entrypoint(spec)``)."""
    values = dict(spec_values)
    spec = Spec(values, values.pop("_source", "pipeline"))
    if entrypoint is not None:
        return entrypoint(spec)
    from pp_core.train import train

    return train(spec)


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


def _endpoint(dist: dict) -> str:
    if dist["rdzv_endpoint"]:
        return dist["rdzv_endpoint"]
    port = dist["master_port"] if dist["master_port"] else free_port(dist["master_addr"])
    return f"{dist['master_addr']}:{port}"


def launch(spec: Spec, entrypoint: Callable | None = None) -> dict[int, Any]:
    """Run the pipeline on this machine's ranks; returns each local rank's return value.

    :param entrypoint: a picklable ``entrypoint(spec)`` to run on every rank instead of
        :func:`pp_core.train.train` (tests use it to inspect a rank from inside).
    When this process is itself a rank (started by torchrun), it just runs that rank.
    """
    if started_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != spec.world_size:
            raise ConfigError(
                f"torchrun started {world} ranks, but distributed.pp_size * dp_size = "
                f"{spec.distributed['pp_size']} * {spec.distributed['dp_size']} = "
                f"{spec.world_size}; pass --nnodes/--nproc-per-node that multiply to "
                f"{spec.world_size}")
        return {int(os.environ.get("LOCAL_RANK", 0)): rank_main(_values(spec), entrypoint)}
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pp_core._torch_compat import tcp_stores_listening_on_their_host

    dist = spec.distributed
    nproc = dist["nproc_per_node"] or spec.world_size // dist["nnodes"]
    endpoint = _endpoint(dist)
    host = endpoint.rsplit(":", 1)[0]
    rdzv_configs: dict[str, Any] = {"timeout": dist["timeout_s"]}
    if dist["rdzv_backend"] == "static":
        rdzv_configs["rank"] = dist["node_rank"] or 0
    config = LaunchConfig(
        min_nodes=dist["nnodes"], max_nodes=dist["nnodes"], nproc_per_node=nproc,
        run_id=dist["rdzv_id"], rdzv_backend=dist["rdzv_backend"], rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs, max_restarts=0, monitor_interval=0.1, start_method="spawn",
        local_addr=host if is_loopback(host) else None,
    )
    # we report a failed rank ourselves, once, below
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    previous = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    listeners = tcp_stores_listening_on_their_host(is_loopback) if is_loopback(host) else \
        contextlib.nullcontext()  # else torch's TCPStore servers listen on every interface
    try:
        with listeners, _loopback_gloo(is_loopback(host)):
            return elastic_launch(config, rank_main)(_values(spec), entrypoint)
    except ChildFailedError as exc:
        raise PipelineError(_failure_message(exc)) from None
    finally:
        for logger, level in zip(quiet, previous):
            logger.setLevel(level)


def _values(spec: Spec) -> dict:
    values = spec.to_dict()
    values["_source"] = spec.source
    return values


def _failure_message(exc) -> str:
    """The first failed rank's error and traceback (the others were stopped because of it)."""
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
    if trace:
        text += "\n" + trace.rstrip()
    return text
