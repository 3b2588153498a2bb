"""What a model and a loss must return, checked by ``validate`` on one microbatch.

The loss of the last stage is backpropagated: it must be a floating-point tensor holding one
number (a vector, an int, a Python float or ``None`` fail as soon as the ranks start). A model
returns a tensor, or a tuple/list whose first item is one (what stages send); a dict, an int or
``None`` is named here instead of torch's ``'dict' object has no attribute ...``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["loss_problem", "output_problem", "initializer_problem"]


def _kind(value: Any) -> str:
    import torch  # lazy: torch is only needed with a value in hand

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


def loss_problem(loss: Any, needs_grad: bool = True) -> str | None:
    """Why ``loss`` cannot be backpropagated as a step's loss (``None``: it can); computed from
    an output that requires grad, it must require grad too (``needs_grad``)."""
    import torch  # lazy: see _kind

    if not isinstance(loss, torch.Tensor):
        return (f"the loss returned {_kind(loss)}, expected a tensor holding one number (e.g. "
                f"the mean of the per-token losses)")
    if not loss.is_floating_point():
        return (f"the loss returned {_kind(loss)}, expected a floating-point tensor (an integer "
                f"tensor has no gradient)")
    if loss.numel() != 1:
        return (f"the loss returned {_kind(loss)}, expected one number; reduce it (.mean() or "
                f".sum())")
    if needs_grad and not loss.requires_grad:
        return ("the loss returned a tensor without gradient (detached from the model's "
                "output: .item(), .detach(), torch.no_grad or a new tensor); compute it from the "
                "output with differentiable operations")
    return None


def output_problem(output: Any) -> str | None:
    """Why a model's ``output`` is not something a stage can send or a loss can read."""
    import torch  # lazy: see _kind

    first = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(first, torch.Tensor) or hasattr(output, "logits"):
        return None
    return (f"the model returned {_kind(output)}, expected a tensor (or a tuple whose first item "
            f"is one); return the logits tensor from forward()")


def initializer_problem(initializer, tokens: int) -> str | None:
    """Why a runtime initializer's ``prepare`` fails on the meta device, blaming its provider
    (a ``"note: "`` when meta itself is the limit), or ``None``."""
    import torch  # lazy: see _kind

    try:
        initializer.prepare(num_tokens=tokens, device=torch.device("meta"))
    except Exception as exc:  # noqa: BLE001 - the provider's code
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        if isinstance(exc, NotImplementedError) or "meta" in str(exc).lower():
            return f"note: one microbatch was not run on the meta device ({why})"
        owner = type(initializer)
        return (f"model: the runtime initializer {owner.__module__}.{owner.__qualname__} "
                f"(resource_key {getattr(initializer, 'resource_key', '?')!r}) raised in "
                f"prepare() ({why}); the model or plugin that provides it is at fault, not "
                f"data.args or model.args")
    return None
