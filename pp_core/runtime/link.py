"""Measure the point-to-point link between two local ranks, from a process that is not a rank.

The YAML launcher plans before any rank exists, so there is no process group to time; this
starts two short-lived processes on the run's backend (gloo on CPU, NCCL between the first two
GPUs), lets them time a small and a large message with
:func:`pp_core.runtime.profile.measure_p2p`, and returns ``(latency_s, bytes_per_s)``. About
two seconds, once per run. The processes rendezvous through a file in a temp dir (no port).
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["measure_local_link"]

def _worker(rank: int, store_path: str, backend: str, device_type: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from pp_core.runtime.profile import measure_p2p

    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    try:
        latency, bandwidth = measure_p2p(dist.group.WORLD)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as fh:
                fh.write(f"{latency!r} {bandwidth!r}")
    finally:
        dist.destroy_process_group()


def measure_local_link(backend: str = "gloo", device_type: str = "cpu") -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` between two processes on this machine."""
    import torch
    import torch.multiprocessing as mp

    if device_type == "cuda" and torch.cuda.device_count() < 2:
        return 0.0, float("inf")  # one GPU: pp ranks share it, hand-offs stay on the device
    with tempfile.TemporaryDirectory(prefix="pp-core-link-") as tmp:
        out = os.path.join(tmp, "link")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), backend, device_type, out),
                 nprocs=2, join=True)
        with open(out, encoding="utf-8") as fh:
            latency, bandwidth = (float(x) for x in fh.read().split())
    return latency, bandwidth
