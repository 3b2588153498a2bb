"""The suite's central claim, written once: a pipelined step's gradients equal one process's.

Runs inside :class:`pp_core.testing.DistPool` ranks. Each rank compares the parameters it holds
with the unsplit model's gradients and returns plain numbers; the test process asserts on them.
What differs between parallelisms is handled here, so a case module only says what it built:

* a DTensor gradient (FSDP2, TP, replicate) is compared as its ``full_tensor()``;
* an expert-parallel parameter (``pp_expert_parallel``) holds this rank's slice of the experts:
  it is compared with the same rows of the reference (``expert_rank`` of ``expert_ranks``);
* a tied weight appears once per part holding a copy, each copy compared with the same reference.

How a difference is scaled is the test's own choice and stays as it was written: ``ABSOLUTE``
(``|g - w|``), ``UNIT`` (``|g - w| / (1 + |w|)``) or ``RELATIVE`` (``|g - w| / |w|``), maxima
over each tensor.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["ABSOLUTE", "RELATIVE", "UNIT", "GradDifference", "full", "grad_difference"]


def ABSOLUTE(want: torch.Tensor) -> float:
    return 1.0


def UNIT(want: torch.Tensor) -> float:
    return 1.0 + want.abs().max().item()


def RELATIVE(want: torch.Tensor) -> float:
    return want.abs().max().item()


class GradDifference(NamedTuple):
    worst: float  # the largest scaled difference over this rank's parameters
    names: list  # the parameter names this rank holds, in part order
    missing: list  # names without a gradient whose reference gradient is not zero
    placements: list  # the DTensor placements of the gradients met, sorted


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of ``tensor``: a DTensor's ``full_tensor()``, any other tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def grad_difference(parts, reference: dict, *, scale: Callable = ABSOLUTE, factor: float = 1.0,
                    expert_rank: int = 0, expert_ranks: int = 1, prefix: str = "",
                    none_is_zero: bool = False, tied_copies: bool = False) -> GradDifference:
    """Compare every parameter gradient of ``parts`` with ``reference`` (``{name: gradient}``
    of the unsplit model, times ``factor``); ``prefix`` is stripped from the parts' names (a
    wrapper's ``module.``). A parameter without ``.grad`` is ``missing`` - unless
    ``none_is_zero`` and the reference's gradient is zero or absent too. ``tied_copies``: a
    parameter a part holds under two names (tied embeddings on one stage) is compared under
    each."""
    worst, names, missing, placements = 0.0, [], [], set()
    for part in parts:
        for name, param in part.named_parameters(remove_duplicate=not tied_copies):
            name = name.removeprefix(prefix)
            names.append(name)
            want = reference[name]
            if want is not None and factor != 1.0:
                want = want * factor
            if want is not None and getattr(param, "pp_expert_parallel", False):
                rows = want.shape[0] // expert_ranks
                want = want[expert_rank * rows:(expert_rank + 1) * rows]
            if param.grad is None:
                if not none_is_zero or (want is not None and want.abs().max() > 0):
                    missing.append(name)
                continue
            if hasattr(param.grad, "placements"):
                placements.add(str(param.grad.placements))
            grad = full(param.grad)
            difference = (grad.float() - want.float()).abs().max().item()
            worst = max(worst, difference / scale(want))
    return GradDifference(worst, names, missing, sorted(placements))


def reference_grads(model: torch.nn.Module) -> dict:
    """``{name: gradient}`` of the unsplit model (tied weights under each of their names)."""
    return {name: param.grad for name, param in model.named_parameters(remove_duplicate=False)}
