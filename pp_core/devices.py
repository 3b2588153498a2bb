"""Which device a pipeline's ranks train on: ``distributed.device`` after ``auto``.

Each local rank takes one GPU (``cuda:LOCAL_RANK``), so CUDA works only when this machine has at
least as many GPUs as ranks it runs. :func:`choose_device` decides from three numbers alone (what
the file asks, how many ranks run here, how many GPUs torch sees), so the rule is testable on any
machine; :class:`pp_core.app.machine.MachineShare` feeds it this machine's facts, once, for the
launcher, ``validate`` and every rank alike. Nothing here reads the YAML spec.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pp_core.errors import ConfigError

__all__ = ["DeviceChoice", "choose_device", "cuda_device_count", "cpu_cores",
           "cpu_threads_per_rank", "shared_processors"]


@dataclass(frozen=True)
class DeviceChoice:
    """The device type ranks use (``"cpu"`` or ``"cuda"``), the backend, and why."""

    device: str
    backend: str
    reason: str


def choose_device(requested: str, local_world_size: int, cuda_devices: int,
                  backend: str = "auto") -> DeviceChoice:
    """The device for ``local_world_size`` ranks on a machine with ``cuda_devices`` GPUs.

    ``auto`` takes CUDA only when every local rank gets a GPU of its own, else the CPU;
    ``cuda`` with too few GPUs raises :class:`ConfigError` saying what to change (torch would
    otherwise fail inside a rank with "invalid device ordinal").
    """
    ranks = f"{local_world_size} rank{'s' if local_world_size != 1 else ''} on this machine"
    gpus = f"{cuda_devices} GPU{'s' if cuda_devices != 1 else ''}"
    enough = cuda_devices >= local_world_size
    if requested == "cuda" and not enough:
        fix = "use device: cpu (or auto)" if not cuda_devices else (
            f"use device: cpu, or at most {cuda_devices} rank(s) per node (pp_size x dp_size / "
            f"nnodes <= {cuda_devices}), one per GPU")
        raise ConfigError(f"distributed.device: cuda needs one GPU per rank: {ranks} need "
                          f"{local_world_size} GPUs; found {cuda_devices}: {fix}")
    if requested == "auto":
        device = "cuda" if cuda_devices and enough else "cpu"
        reason = (f"auto: {gpus} for {ranks}" if device == "cuda" else
                  "auto: no GPU" if not cuda_devices else
                  f"auto: {ranks} but only {gpus}; set device: cuda with fewer ranks per node")
    else:
        device, reason = requested, f"distributed.device: {requested}"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    elif backend == "nccl" and device != "cuda":
        raise ConfigError(f"distributed.backend: nccl needs CUDA tensors, but the ranks run on "
                          f"the cpu ({reason}); use backend: gloo or auto")
    return DeviceChoice(device, backend, reason)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or ``taskset``
    narrows; ``os.cpu_count`` where the platform has no mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_threads_per_rank(local_world_size: int, environ=None) -> int:
    """The intra-op threads of one CPU rank: ``OMP_NUM_THREADS`` when set, else the cores
    shared evenly among the ranks on this machine (at least one). The launcher measures with
    the same count the ranks train with."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:  # unset, or not a count
        return max(1, cpu_cores() // max(1, local_world_size))


def shared_processors(cores: int, threads_per_rank: int, local_world_size: int,
                      pp_size: int) -> float | None:
    """How many ranks' worth of processors one pipeline's CPU ranks share, or ``None`` when
    each rank has its own (the planner's simulator then needs no sharing).

    The ranks on a machine share its cores; a rank running ``threads_per_rank`` threads needs
    that many to go at the speed it was profiled at, so the machine runs ``cores / threads``
    ranks at full speed, and one pipeline (of ``local_world_size / pp_size`` on the machine,
    stepping in lockstep with data parallelism) gets its share. A pipeline spread over several
    machines (``local_world_size < pp_size``) is not modelled: ``None``.
    """
    if local_world_size < pp_size or pp_size < 1:
        return None
    processors = cores / max(1, threads_per_rank) * pp_size / local_world_size
    return processors if processors < pp_size else None


def cuda_device_count() -> int:
    """GPUs torch can use here (0 without a CUDA build or driver)."""
    import torch  # lazy: torch, the core loads no torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
