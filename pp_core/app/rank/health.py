"""Training health: a step whose loss or gradient norm is not finite is never applied.

``train.on_nonfinite`` says what happens instead: ``stop`` (the default) ends the run with a
message and a non-zero exit before the optimizer touches the weights, so the last checkpoint
stays the last good one; ``skip`` drops that step's update and goes on (the step is logged with
``skipped: true``). The loss is the mean over the dp replicas and the norm the global one
(:func:`pp_core.parallel.gradients.clip_grad_norm`), so every rank decides alike without
another message. :func:`weights_finite` guards a save on its own: a checkpoint never holds
non-finite weights, whatever made them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pp_core.errors import PipelineError

__all__ = ["NonFiniteStep", "apply_update", "weights_finite"]

MODES = ("stop", "skip")


class NonFiniteStep(PipelineError):
    """A step's loss or gradient norm was NaN or infinite and ``train.on_nonfinite`` is stop."""


def _bad(value) -> bool:
    return value is not None and not math.isfinite(float(value))


def apply_update(step: int, loss: float | None, grad_norm: float | None, mode: str,
                 say) -> bool:
    """Whether this step's update is applied; raises :class:`NonFiniteStep` when it must stop."""
    what = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
            if _bad(value)]
    if not what:
        return True
    if mode == "skip":
        say(f"step {step}: {' and '.join(what)}: this step's update is skipped "
            f"(train.on_nonfinite: skip)")
        return False
    raise NonFiniteStep(f"step {step}: the {' and '.join(what)} is not finite; training stopped "
                        f"before the update, so the weights and the last checkpoint are those of "
                        f"step {step - 1}. Lower train.optimizer.lr, set train.grad_clip, check "
                        f"the data and the loss, or set train.on_nonfinite: skip to skip such "
                        f"steps")


def _local(param):
    value = param.detach()
    return value.to_local() if hasattr(value, "to_local") else value  # an FSDP2 shard


def weights_finite(parts, device) -> bool:
    """Whether every parameter of every rank is finite (a collective over the default group)."""
    bad = any(not torch.isfinite(_local(p)).all() for part in parts for p in part.parameters()
              if p.is_floating_point())
    flag = torch.tensor([1.0 if bad else 0.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag)
    return float(flag) == 0.0
