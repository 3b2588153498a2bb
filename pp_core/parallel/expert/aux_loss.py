"""Auxiliary losses of a layer (an MoE load-balancing loss) that reach the parameters as if added
to the last stage's loss, with the scale the running step gives them.

A model layer's auxiliary loss must reach its parameters with the gradient it would get if it
were added to the last stage's microbatch loss - but that loss lives on another rank. The layer
injects the gradient in its own backward (:func:`inject_aux_loss`; Megatron's
``MoEAuxLossAutoScaler``), multiplied by the factor the schedule applies to the last stage's
loss: 1, or ``1 / num_microbatches`` with ``scale_grads_in_schedule``.

That factor travels with the step, not through a process-global: the executor keeps it in the
step's :class:`~pp_core.runtime.step_state.StepState` and, before the step's first action,
hands it to the layers that keep auxiliary losses (:func:`scale_aux_losses` on
:func:`aux_loss_modules`: every module with a ``pp_aux_losses`` list, the convention :func:`pp_core.losses.pop_aux_losses` reads); each
layer passes its own ``pp_aux_loss_scale`` to :func:`inject_aux_loss`. Outside a pipeline step
the scale is the layer's default, 1 (the loss used as is); a one-process reference that mimics a
scaled schedule calls ``scale_aux_losses(aux_loss_modules([model]), scale)`` itself.
"""

from __future__ import annotations

import torch

__all__ = ["inject_aux_loss", "scale_aux_losses", "aux_loss_modules", "SCALE_ATTRIBUTE"]

SCALE_ATTRIBUTE = "pp_aux_loss_scale"


def aux_loss_modules(model_parts) -> list:
    """The modules of ``model_parts`` that keep auxiliary losses (a ``pp_aux_losses`` list)."""
    return [module for part in model_parts for module in part.modules()
            if isinstance(getattr(module, "pp_aux_losses", None), list)]


def scale_aux_losses(modules, scale: float) -> None:
    """Give each of ``modules`` (:func:`aux_loss_modules`) the step's ``scale`` as its
    ``pp_aux_loss_scale``."""
    for module in modules:
        setattr(module, SCALE_ATTRIBUTE, float(scale))


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on ``hidden``; in backward, gives ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, hidden, aux, scale):
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def inject_aux_loss(hidden: torch.Tensor, aux: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``hidden`` unchanged; ``aux`` (a 0-dim float32 loss) gets the gradient ``scale`` in
    backward (pass the layer's ``pp_aux_loss_scale``: what the running step gave it)."""
    if not (torch.is_grad_enabled() and aux.requires_grad):
        return hidden
    return _InjectAuxLoss.apply(hidden, aux, float(scale))
