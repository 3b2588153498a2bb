"""Where the ranks meet: the rendezvous address, checked before any process starts.

torch's c10d rendezvous trusts its endpoint blindly: on a port another program holds it talks to
that program forever; on a bind-all or unrecognised own address it waits minutes for a store
nobody hosts. So the launcher settles the endpoint first, in Python (so Ctrl-C acts at once):

- the syntax of ``master_addr`` / ``master_port`` / ``rdzv_endpoint``
  (:mod:`pp_core.app.spec.endpoint`: the spec schema checks the same values with it);
- that the address resolves, and whether it is this machine's (a test bind);
- that a named port is free, or (several nodes) held by another node's torch store;
- on a node that is not the host, that the host listens, waiting at most ``timeout_s``.

The result says whether this node hosts the store, so torch never has to guess.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from pp_core.app.spec.endpoint import address_problem, port_problem, split_endpoint
from pp_core.errors import ConfigError, PipelineError

if TYPE_CHECKING:
    from pp_core.app.spec.sections import DistributedSpec

__all__ = ["Endpoint", "address_problem", "split_endpoint", "port_problem", "prepare_endpoint",
           "resolve", "started_by_torchrun"]


def started_by_torchrun(environ=None) -> bool:
    """Whether this process is already one rank of a launched job (torchrun, elastic agent)."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


@dataclass(frozen=True)
class Endpoint:
    """The rendezvous endpoint as settled: whether this node hosts the store, and the YAML keys
    that name its address and port (for messages)."""

    host: str
    port: int
    is_host: bool
    address_key: str
    port_key: str

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _named(dist: DistributedSpec) -> tuple[str, int, str, str]:
    """``(host, port or 0, key naming the host, key naming the port)``."""
    if dist.rdzv_endpoint:
        host, port = split_endpoint(dist.rdzv_endpoint)
        return host, port, "distributed.rdzv_endpoint", "distributed.rdzv_endpoint"
    return (dist.master_addr, dist.master_port or 0, "distributed.master_addr",
            "distributed.master_port")


def resolve(dist: DistributedSpec) -> tuple[int, tuple]:
    """The address family and socket address of the rendezvous host; ConfigError if unknown."""
    host, port, address_key, _ = _named(dist)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{address_key}: cannot resolve {host!r} "
                          f"({getattr(exc, 'strerror', None) or exc}); name the rendezvous "
                          f"host by an IP address or a name this machine resolves") from None
    return family, sockaddr


def prepare_endpoint(dist: DistributedSpec) -> Endpoint:
    """Check the endpoint of ``distributed`` on this machine; a port of 0/unset becomes a free one.

    Raises :class:`ConfigError` (naming the key) for an address that does not resolve, an address
    of another machine with ``nnodes: 1``, or a port held by another program; and
    :class:`PipelineError` when, on a node that does not host the store, nobody listens within
    ``timeout_s``.
    """
    host, port, address_key, port_key = _named(dist)
    family, sockaddr = resolve(dist)
    one_node = dist.max_nodes == 1
    if dist.node_rank and dist.rdzv_backend == "c10d" and not one_node and port:
        # node_rank > 0 never hosts the c10d store, even where its port is free: it waits for
        # the host (so nodes on one machine may start in any order)
        endpoint = Endpoint(host, port, False, address_key, port_key)
        _wait_for_listener(endpoint, dist.timeout_s)
        if not _speaks_tcpstore(endpoint):
            raise ConfigError(f"{port_key}: port {port} on {host} is in use by another "
                              f"program, not the rendezvous of node_rank 0: choose another "
                              f"{port_key.split('.', 1)[1]}")
        return endpoint
    free, failure = _try_bind(family, sockaddr[0], port)
    if failure is None:
        return Endpoint(host, free, True, address_key, port_key)
    endpoint = Endpoint(host, port, False, address_key, port_key)
    if failure == errno.EADDRNOTAVAIL:
        if one_node:
            raise ConfigError(
                f"{address_key}: {host} is not an address of this machine, but with nnodes: 1 "
                f"every rank runs here; leave it unset (127.0.0.1) or name this machine's own "
                f"address")
        if not port:
            raise ConfigError(f"{port_key}: expected the port the rendezvous host listens on, "
                              f"found none")
        _wait_for_listener(endpoint, dist.timeout_s)
    elif failure != errno.EADDRINUSE:
        raise ConfigError(f"{port_key}: cannot listen on {endpoint} "
                          f"({os.strerror(failure)}); "
                          f"choose another port (>= 1024 without privileges)")
    if one_node or not _speaks_tcpstore(endpoint):
        raise ConfigError(
            f"{port_key}: port {port} on {host} is in use by another program: choose another "
            f"{port_key.split('.', 1)[1]}"
            + (" or leave it unset for a free one" if port_key.endswith("master_port") else ""))
    return endpoint


def _try_bind(family: int, address: str, port: int) -> tuple[int, int | None]:
    """Bind (not listen) ``address:port`` as a store would: ``(port, None)`` or ``(0, errno)``."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        try:
            sock.bind((address, port))
        except OSError as exc:
            return 0, exc.errno
        return sock.getsockname()[1], None


def _wait_for_listener(endpoint: Endpoint, timeout_s: float) -> None:
    """Poll until something accepts connections at ``endpoint`` (interruptible by Ctrl-C)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((endpoint.host, endpoint.port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"nothing listens on the rendezvous endpoint {endpoint} after "
                    f"distributed.timeout_s = {timeout_s:g} s: start pp-core run on the host "
                    f"{endpoint.host} (node 0) too, or check {endpoint.address_key}, "
                    f"{endpoint.port_key} and the firewall") from None
            time.sleep(0.1)


def _speaks_tcpstore(endpoint: Endpoint, seconds: float = 5.0) -> bool:
    """Whether a torch TCPStore answers at ``endpoint`` (another node's agent on this machine).

    A TCPStore client waits forever on a server that never answers, so the probe runs in a
    daemon thread and is abandoned after ``seconds``.
    """
    import torch.distributed as dist  # lazy: torch.distributed, only to probe a store

    answered = threading.Event()

    def probe():
        try:
            store = dist.TCPStore(endpoint.host, endpoint.port, is_master=False,
                                  timeout=timedelta(seconds=seconds))
            store.check(["pp_core/probe"])
            answered.set()
        except Exception:
            pass

    threading.Thread(target=probe, daemon=True, name="pp-core-store-probe").start()
    return answered.wait(seconds)
