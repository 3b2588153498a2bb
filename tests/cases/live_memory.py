"""The live-tensor figure the memory-model tests compare with the planner's prediction."""

from __future__ import annotations

import torch


def step_live_bytes(pipe, inputs, target) -> int:
    """On every rank: two ``Pipeline.step`` + AdamW steps to make the optimizer state and reach
    the steady state (from the third step on, gloo's receives of every input are posted at the
    step's start, sized by the steps before), then the measured one; parameters + optimizer
    state + the allocation log's peak (live tensors, not the resident set: deterministic)."""
    import torch.distributed as dist

    from pp_core.measure.transient import Allocations

    optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3) for part in pipe.model_parts]
    for _ in range(3):
        for part in pipe.model_parts:
            part.zero_grad(set_to_none=True)
        dist.barrier()
        log = Allocations()
        with log.tracking():
            pipe.step(inputs, target=target)
            for optimizer in optimizers:
                optimizer.step()
    params = sum(p.numel() * p.element_size() for part in pipe.model_parts
                 for p in part.parameters())
    state = sum(t.numel() * t.element_size() for optimizer in optimizers
                for per_param in optimizer.state.values() for t in per_param.values()
                if isinstance(t, torch.Tensor))
    return params + state + log.peak()
