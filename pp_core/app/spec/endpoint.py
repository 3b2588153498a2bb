"""The rendezvous keys as text: an address, a port, ``host:port`` - checked without a lookup.

The spec schema checks ``master_addr`` / ``master_port`` / ``rdzv_endpoint`` with these, and the
launcher's :mod:`pp_core.app.rendezvous` settles the same values on the network, so ``validate``
refuses exactly what a launch would.
"""

from __future__ import annotations

import ipaddress
import re

BIND_ALL = "a bind-all address, meaning every interface of a machine"
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")


def address_problem(host: str) -> str | None:
    """Why ``host`` cannot name the rendezvous host (``None`` when it can); no lookups."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_unspecified:
            return (f"an address peers can connect to ({host} is {BIND_ALL}): 127.0.0.1 on one "
                    f"machine, or the rendezvous host's reachable address")
        return None
    if ":" in text:
        return "a host name or IP address without a port (the port goes in master_port)"
    if not _HOSTNAME.match(text) or text.replace(".", "").isdigit():
        return "a host name or IP address, e.g. 127.0.0.1 or node0.cluster"
    return None


def port_problem(port: int) -> str | None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        return "a TCP port 1..65535 (leave it unset for a free one)"
    return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) into its parts; ValueError says what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError("host:port, e.g. 127.0.0.1:29500")
    if ":" in host and not host.startswith("["):
        raise ValueError("host:port with an IPv6 host in brackets, e.g. [::1]:29500")
    problem = address_problem(host) or port_problem(int(port))
    if problem is None and int(port) == 0:
        problem = "host:port with a port 1..65535"
    if problem is not None:
        raise ValueError(problem)
    return host.strip("[]"), int(port)
