"""The token-exact loss: one count of the step's valid target tokens, before the schedule runs.

A loss that declares ``num_valid_tokens`` (:func:`pp_core.losses.counts_tokens`; the built-in
``cross_entropy`` and the HF ``causal_lm_loss`` do) returns, per microbatch, the sum of its
per-token losses divided by ``N``, the number of valid target tokens of the *whole step*: every
microbatch of this rank and of every rank of the data-parallel group. So the microbatch losses
of every dp rank sum to the unsplit model's mean loss over the global batch, however the valid
tokens fall into microbatches.

The pipeline multiplies each such loss by ``M * D`` (microbatches per step times the dp group's
size) before it records and back-propagates it. That keeps the seed contracts word for word:
``step`` returns the *mean* microbatch loss, the gradient is that of the *sum* of the microbatch
losses (of their mean with ``scale_grads_in_schedule=True``), and torch's dp engines *average*
over the dp ranks; with these losses, mean over microbatches and dp ranks = the global-batch
loss, and the averaged gradient of the mean = its gradient.

The count is one ``all_reduce`` (a single int64) over the dp group, made by the ranks that hold
the last stage - the only ones that compute a loss; a dp group's ranks all sit at the same
pipeline position, so they all take part or none does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pp_core.errors import ConfigError
from pp_core.losses import token_counter

__all__ = ["resolve_dp_group", "step_token_count"]


def resolve_dp_group(dp_group) -> tuple[Any, int]:
    """``(process group or None, size)`` for a ProcessGroup, a DeviceMesh (of any number of
    dimensions: an HSDP mesh counts all of its ranks) or ``None`` (no data parallelism)."""
    if dp_group is None:
        return None, 1
    import torch.distributed as dist  # lazy: only with data parallelism

    if hasattr(dp_group, "get_group") and hasattr(dp_group, "ndim"):
        if dp_group.ndim > 1:
            from pp_core._torch_compat import flatten_mesh  # lazy: private torch API

            dp_group = flatten_mesh(dp_group)
        dp_group = dp_group.get_group()
    if not isinstance(dp_group, dist.ProcessGroup):
        raise ConfigError(f"dp_group must be a ProcessGroup or a DeviceMesh of the data-parallel "
                          f"ranks, got {type(dp_group).__name__}")
    size = dist.get_world_size(dp_group)
    return (dp_group if size > 1 else None), size


def step_token_count(loss_fn, mb_targets: list, dp_group, device) -> torch.Tensor:
    """``N``: the valid target tokens of the step's microbatches, summed over ``dp_group``
    (a 0-dim int64 tensor on ``device``, at least 1 so that an all-masked step gives loss 0)."""
    count_fn = token_counter(loss_fn)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for target in mb_targets:
        try:
            count = count_fn(target)
        except Exception as exc:
            raise ConfigError(f"the loss {getattr(loss_fn, '__name__', loss_fn)!r} counts the "
                              f"step's valid target tokens with {count_fn.__name__}(target), "
                              f"which failed: {exc}; give the loss a count_valid_tokens(target) "
                              f"attribute that returns the count") from exc
        total += count.to(device) if isinstance(count, torch.Tensor) else int(count)
    if dp_group is not None:
        import torch.distributed as dist  # lazy: only with data parallelism

        dist.all_reduce(total, group=dp_group)
    return total.clamp_min(1)


def scaled_loss(loss_fn, output, target, count: Optional[torch.Tensor], factor: float):
    """The loss of one microbatch: plain, or token-normalised and multiplied by ``M * D``."""
    if count is None:
        return loss_fn(output, target)
    return loss_fn(output, target, num_valid_tokens=count) * factor
