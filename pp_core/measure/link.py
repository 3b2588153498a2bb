"""Measure the point-to-point link between two local ranks, from a process that is not a rank.

The YAML launcher plans before any rank exists, so there is no process group to time; this
starts two short-lived processes on the run's backend (gloo on CPU, NCCL between the first two
GPUs), lets them time a small and a large message with
:func:`measure_p2p`, what a message costs each rank with
:func:`measure_p2p_busy` and the executor's time per action with
:func:`pp_core.measure.overhead.measure_action_overhead`, and returns the
:class:`~pp_core.planning.costs.Link`. About three seconds, once per run. The
processes rendezvous through a file in a temp dir (no port).

Why the busy time: latency is what a hand-off adds to the *dependency*; but the ranks pay too:
gloo on the CPU frames and copies the bytes in the sending and the receiving process, and a send
can hold the rank up while the communication threads wait for a core. A looped plan hands off at
every stage boundary, so it pays this many times per step.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from dataclasses import astuple
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from pp_core.errors import ConfigError
from pp_core.measure.helpers import HELPER_TIMEOUT_S, run_helpers
from pp_core.measure.overhead import measure_action_overhead
from pp_core.planning.costs import Link

__all__ = ["measure_local_link", "measure_p2p", "measure_p2p_busy", "sync"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BUSY_SIZES = (4, 1 << 18)
"""float32 elements of the small and the large message :func:`measure_p2p_busy` streams."""


def measure_p2p_busy(group=None, sizes=BUSY_SIZES, *, device=None, count: int = 20,
                     compute_s: float = 1e-3) -> tuple[float, float, float]:
    """``(send_busy_s, recv_busy_s, busy_bytes_per_s)``: the time a rank is held up by one
    send and by one receive between the group's first two ranks, as a pipeline step uses them.

    Both ranks do what an executor does around a hand-off, ``count`` times after one warm-up,
    for a message of ``sizes[0]`` and one of ``sizes[-1]`` float32 elements: post the receive
    early, compute (``compute_s`` of matmuls), send (its own tag, as the runtime's gradient
    messages have), compute, take the received message. The wall time of the send call is the
    send's busy time, the wait for the already-arrived message the receive's (the peer
    computes meanwhile, as in a pipeline: on a machine with few cores the communication
    threads then compete with compute, which is what a rank pays). Medians over messages and
    both ranks; the fixed part is the small message's, the rate from the extra bytes of the
    large one over its extra time. A group of one rank returns ``(0.0, 0.0, inf)``.
    """
    pair = link_pair(group, sizes, device, "measure_p2p_busy")
    if pair is None:
        return 0.0, 0.0, math.inf
    ranks, small, large, device = pair
    me = dist.get_rank()
    found = torch.zeros(4, dtype=torch.float64, device=device)  # send small/large, recv ...
    if me in ranks[:2]:
        peer = ranks[1] if me == ranks[0] else ranks[0]
        work = torch.randn(64, 64, device=device)

        def compute():
            start = time.perf_counter()
            while time.perf_counter() - start < compute_s:
                work @ work
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for slot, numel in enumerate((small, large)):
            out = torch.zeros(numel, dtype=torch.float32, device=device)
            into = torch.zeros(numel, dtype=torch.float32, device=device)
            sends, recvs = [], []
            for trip in range(count + 1):  # the first one warms the connection up
                tag = 64 + slot * (count + 1) + trip
                incoming = dist.irecv(into, peer, group=group, tag=tag)
                compute()
                start = time.perf_counter()
                outgoing = dist.isend(out, peer, group=group, tag=tag)
                sends.append(time.perf_counter() - start)
                compute()
                start = time.perf_counter()
                incoming.wait()
                recvs.append(time.perf_counter() - start)
                outgoing.wait()
            found[slot] = statistics.median(sends[1:]) / 2  # both ranks' halves add up
            found[slot + 2] = statistics.median(recvs[1:]) / 2
    dist.all_reduce(found, group=group)
    send_small, send_large, recv_small, recv_large = found.tolist()
    extra = max(send_large - send_small, 0.0) + max(recv_large - recv_small, 0.0)
    rate = (large - small) * 4 / extra if extra > 0 else math.inf
    return send_small, recv_small, rate


def _worker(rank: int, store_path: str, backend: str, device_type: str, out_path: str) -> None:
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, 2)
    # bounded waits: a helper whose peer or parent is gone ends by itself (torch's default: 30 min)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=HELPER_TIMEOUT_S))
    try:
        link = Link(*measure_p2p(dist.group.WORLD), *measure_p2p_busy(dist.group.WORLD),
                    measure_action_overhead(dist.group.WORLD, device=device_type))
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as fh:
                fh.write(" ".join(map(repr, astuple(link))))
    finally:
        dist.destroy_process_group()


def measure_local_link(backend: str = "gloo", device_type: str = "cpu") -> Link:
    """The :class:`~pp_core.planning.costs.Link` between two processes on this machine."""
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        # one GPU: pp ranks share it, hand-offs stay on the device
        return Link()
    with tempfile.TemporaryDirectory(prefix="pp-core-link-") as tmp:
        out = os.path.join(tmp, "link")
        run_helpers(_worker, (os.path.join(tmp, "store"), backend, device_type, out), 2,
                    died="a link-measuring helper process ended before it finished ({}); the "
                         "link was not measured (skip measuring with 'pp-core plan --no-link')",
                    failed="measuring the link between two local processes failed")
        with open(out, encoding="utf-8") as fh:
            return Link.of(fh.read().split())


def measure_p2p(group=None, sizes: Sequence[int] = (4, 1 << 22), *, device=None,
                round_trips: int = 5) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of a send/recv between the group's first two ranks.

    Rank 0 and rank 1 of ``group`` bounce a float32 tensor of ``sizes[0]`` elements (latency:
    half the median round trip) and one of ``sizes[-1]`` elements (bandwidth from the extra
    bytes over the extra time) ``round_trips`` times each after one warm-up; every rank of the
    group then gets rank 0's numbers (a broadcast), so all ranks plan alike. A group of one rank
    returns ``(0.0, inf)``: there is no link.
    """
    pair = link_pair(group, sizes, device, "measure_p2p")
    if pair is None:
        return 0.0, math.inf
    ranks, small, large, device = pair
    me = dist.get_rank()
    result = torch.zeros(2, dtype=torch.float64, device=device)
    if me in ranks[:2]:
        peer = ranks[1] if me == ranks[0] else ranks[0]
        times = [_round_trips(n, me == ranks[0], peer, group, device, round_trips)
                 for n in (small, large)]
        half = [statistics.median(t) / 2 for t in times]
        extra_s = max(half[1] - half[0], 1e-9)
        result[0], result[1] = half[0], (large - small) * 4 / extra_s
    dist.broadcast(result, src=ranks[0], group=group)
    return float(result[0]), float(result[1])


def link_pair(group, sizes: Sequence[int], device, what: str):
    """What every link measurement starts with: ``(group ranks, small numel, large numel,
    device)`` - the device the backend sends from unless given - or ``None`` for a group of one
    rank, which has no link. Refuses a missing process group and sizes that do not grow."""
    if not dist.is_initialized():
        raise ConfigError(f"{what} needs an initialised process group "
                          f"(torch.distributed.init_process_group)")
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    if len(ranks) < 2:
        return None
    small, large = int(sizes[0]), int(sizes[-1])
    if large <= small:
        raise ConfigError(f"{what}: sizes={list(sizes)} must end larger than they start")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return ranks, small, large, device


def _round_trips(numel: int, leader: bool, peer: int, group, device, count: int) -> list[float]:
    buffer = torch.zeros(numel, dtype=torch.float32, device=device)
    times = []
    for trip in range(count + 1):  # the first one warms the connection up
        sync(device)
        start = time.perf_counter()
        if leader:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
        sync(device)
        if trip:
            times.append(time.perf_counter() - start)
    return times
