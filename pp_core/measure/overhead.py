"""The executor's own time per action, measured on a tiny real pipeline.

The profile times each unit's compute alone; a real step also runs the executor around every
action: Python dispatch, posting, matching and reaping messages, setting up each backward call.
On CPU ranks that time takes the core the compute needs, so the planner charges it per action
(:func:`pp_core.planning.refine.handoff_charges`). Measured where it happens: every rank of the
group runs a few steps of a pipeline whose units do almost no compute, and its CPU seconds per
step over the compute actions it ran are the overhead (the tiny units' own compute, a few
microseconds per action, is included: a slight over-estimate). A looped schedule is used, so
that each action also makes the hand-offs a looped plan makes. On GPUs the executor's time
overlaps the kernels it launched, so it is not charged there (0).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from pp_core.config import PipelineConfig
from pp_core.runtime.build import build_pipeline

__all__ = ["measure_action_overhead"]


class _Tiny(nn.Module):
    """A ``layers`` model of 16-wide linear blocks: real stages, next to no compute."""

    def __init__(self, num_layers: int, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def measure_action_overhead(group=None, *, device="cpu", steps: int = 6,
                            schedule: str = "interleaved_1f1b") -> float:
    """Seconds of the executor's own CPU time per compute action, the mean over the group's
    ranks (the same number on every rank: a collective, call it on all of them)."""
    device = torch.device(device)
    if device.type != "cpu":
        return 0.0
    ranks = dist.get_world_size(group)
    if ranks < 2:
        return 0.0
    microbatches = 2 * ranks
    config = PipelineConfig(pp_schedule=schedule, pp_batch_size=2 * microbatches,
                            pp_microbatch_size=2, loss_fn="mse")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _Tiny(2 * ranks)
    pipe = build_pipeline(model, config, pp_group=group, device=device)
    x = torch.zeros(2 * microbatches, 16)
    actions = sum(1 for a in pipe.schedule.actions[pipe.rank] if a is not None)
    seconds = []
    for step in range(steps + 2):  # two warm-up steps: shapes learned, buffers allocated
        dist.barrier(group=group)
        start = time.process_time()
        pipe.step(x, target=x)
        if step >= 2:
            seconds.append(time.process_time() - start)
    mean = torch.tensor([statistics.median(seconds) / actions / ranks], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    return float(mean)
