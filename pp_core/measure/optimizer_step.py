"""What the end of a training step costs per trained parameter byte, measured on this device.

Every rank ends a step with the gradient norm and its optimizer over the parameters it trains,
after the pipeline has drained: time the pipeline makespan does not hold. The planner charges it
per rank (:func:`pp_core.planning.refine.optimizer_step_s`) from one rate measured here: the
norm (:func:`pp_core.parallel.gradients.clip_grad_norm`, as a run computes it) and AdamW (the
implementation torch picks by default, as ``train.optimizer`` builds it) over copies of the
model's trainable parameters with gradients, warmed up once (the first step allocates its
state), the median of ``repeats`` steps over their bytes.
"""

from __future__ import annotations

import statistics
import time

import torch

from pp_core.parallel.gradients import clip_grad_norm

__all__ = ["measure_optimizer_rate"]

MAX_BYTES = 256 << 20  # enough tensors for a steady rate without doubling a large model


def measure_optimizer_rate(model: torch.nn.Module, device="cpu", repeats: int = 3) -> float:
    """Seconds per trained parameter byte of one gradient norm and AdamW step (0.0: nothing
    to train)."""
    copies, total = [], 0
    for param in model.parameters():
        if not param.requires_grad or param.is_meta or total >= MAX_BYTES:
            continue
        copy = torch.nn.Parameter(param.detach().to(device).clone())
        copy.grad = torch.randn_like(copy)
        copies.append(copy)
        total += copy.numel() * copy.element_size()
    if not copies:
        return 0.0
    optimizer = torch.optim.AdamW(copies, lr=1e-3)
    optimizer.step()  # the state is allocated by the first step
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        clip_grad_norm(copies, None, None)
        optimizer.step()
        if copies[0].device.type == "cuda":
            torch.cuda.synchronize(copies[0].device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) / total
