"""What a model and a loss must return, checked by ``validate`` on one microbatch.

The loss of the last stage is backpropagated: it must be a floating-point tensor holding one
number (a vector, an int, a Python float or ``None`` fail as soon as the ranks start). A model
returns a tensor, or a tuple/list whose first item is one (what stages send); a dict, an int or
``None`` is named here instead of torch's ``'dict' object has no attribute ...``.
"""

from __future__ import annotations

import os
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


PREPARE_TIMEOUT_ENV = "PP_CORE_PREPARE_TIMEOUT"
PREPARE_TIMEOUT_S = 60.0


def _prepare_limit() -> float:
    try:
        value = float(os.environ.get(PREPARE_TIMEOUT_ENV, PREPARE_TIMEOUT_S))
    except ValueError:
        return PREPARE_TIMEOUT_S
    return value if value > 0 else PREPARE_TIMEOUT_S


def initializer_problem(initializer, tokens: int) -> str | None:
    """Why a runtime initializer's ``prepare`` fails on the meta device, blaming its provider
    (a ``"note: "`` when meta itself is the limit), or ``None``.

    ``prepare`` runs in a thread for at most ``$PP_CORE_PREPARE_TIMEOUT`` seconds (60): one that
    blocks is reported, not waited for (validate used to hang), and any ``BaseException`` it
    raises (``SystemExit(3)`` ended validate with exit 3 and no word) is reported like the others.
    """
    import threading  # lazy: only with an initializer in hand

    import torch  # lazy: see _kind

    owner = type(initializer)
    blame = (f"model: the runtime initializer {owner.__module__}.{owner.__qualname__} "
             f"(resource_key {getattr(initializer, 'resource_key', '?')!r})")
    raised: list[BaseException] = []

    def run():
        try:
            initializer.prepare(num_tokens=tokens, device=torch.device("meta"))
        except BaseException as exc:  # noqa: BLE001 - the provider's code, SystemExit included
            raised.append(exc)

    limit = _prepare_limit()
    thread = threading.Thread(target=run, name="pp-core validate: prepare()", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return (f"{blame} did not return from prepare(num_tokens={tokens}, device=meta) within "
                f"{limit:g} s (${PREPARE_TIMEOUT_ENV}); the executor calls it before every "
                f"microbatch, so the run would hang there: the model or plugin that provides it "
                f"must not block")
    if not raised:
        return None
    exc = raised[0]
    why = f"{type(exc).__name__}: {str(exc)[:200]}"
    if isinstance(exc, NotImplementedError) or \
            (isinstance(exc, Exception) and "meta" in str(exc).lower()):
        return f"note: one microbatch was not run on the meta device ({why})"
    return (f"{blame} raised in prepare() ({why}); the model or plugin that provides it is at "
            f"fault, not data.args or model.args")
