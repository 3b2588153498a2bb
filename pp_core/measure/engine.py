"""What torch's data-parallel engine costs a rank besides its collectives: :func:`time_engine`.

A dp layout wraps every block and every stage in FSDP2 (``replicate`` or ``fully_shard``), and
that costs CPU time a plain profile does not hold: the engine's hooks around every forward and
backward of a wrapped module (pp-core runs them without per-call collectives,
:mod:`pp_core.runtime.dp_sync`), and the optimizer step and gradient norm over parameters that
are DTensors, where every elementwise op goes through DTensor's dispatch. On a small CPU
model these were a third of a pp 2 x dp 2 rank's step (py-spy, docs/benchmarks.md).

Timed here on a stand-in block (a norm and two linear layers, narrow: its own arithmetic is
noise beside the engine's) plain and wrapped, by one rank while its peers wait (one thread, as
a CPU rank runs; the simulator shares the cores itself). The differences, per call and per
parameter tensor (the same at widths 32 to 256: DTensor's dispatch costs per op, not per byte),
are :class:`pp_core.planning.collectives.EngineCosts`. Called in the collectives' helper processes
(:mod:`pp_core.measure.collectives`), which already hold a process group.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from pp_core.parallel.gradients import clip_grad_norm
from pp_core.planning.collectives import EngineCosts

__all__ = ["time_engine"]

WIDTH, TOKENS = 32, 16


def _stand_in() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                         nn.Linear(4 * WIDTH, WIDTH))


def _costs(module: nn.Module, repeats: int) -> tuple[float, float, float]:
    """``(forward_s, backward_s, step_s)`` of ``module``, medians after one warm-up: a
    forward, its backward, and the end of a training step (gradient norm, AdamW step)."""
    inputs = torch.randn(TOKENS, WIDTH)
    params = list(module.parameters())  # wrapped: the sharded DTensors an optimizer holds
    forwards, backwards, steps = [], [], []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        loss = module(inputs).sum()
        between = time.perf_counter()
        loss.backward()
        forwards.append(between - started)
        backwards.append(time.perf_counter() - between)
    if hasattr(module, "reshard"):  # the optimizer steps the sharded parameters
        module.reshard()
    for param in params:  # the engine keeps a step's gradients until it reduces them
        param.grad = torch.full_like(param, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(repeats + 1):
        started = time.perf_counter()
        clip_grad_norm(params, None, None)
        optimizer.step()
        steps.append(time.perf_counter() - started)
    return tuple(statistics.median(times[1:]) for times in (forwards, backwards, steps))


def time_engine(mesh, repeats: int = 9) -> EngineCosts:
    """The engine's extra work per wrapped module and call, and per parameter tensor and step,
    on a 1-D ``mesh`` of the helper processes (every rank of it calls this; rank 0 times)."""
    from pp_core.parallel.data_parallel import apply_data_parallel  # lazy: FSDP2

    plain, wrapped = _stand_in(), _stand_in()
    apply_data_parallel([wrapped], mesh, shard=False)  # collective: every rank wraps
    wrapped.set_requires_gradient_sync(False)  # as a pipeline step drives it
    wrapped.set_reshard_after_backward(False)  # (pp_core.runtime.dp_sync)
    wrapped.set_is_last_backward(False)
    found = torch.zeros(3, dtype=torch.float64)
    if dist.get_rank() == 0:
        base, engine = _costs(plain, repeats), _costs(wrapped, repeats)
        tensors = sum(1 for _ in plain.parameters())
        found = torch.tensor([engine[0] - base[0], engine[1] - base[1],
                              (engine[2] - base[2]) / tensors], dtype=torch.float64)
    dist.broadcast(found, src=0)
    return EngineCosts(*(max(0.0, value) for value in found.tolist()))
