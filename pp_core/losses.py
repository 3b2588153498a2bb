"""Built-in loss functions a pipeline can name (``loss_fn: cross_entropy`` in YAML).

Every loss takes ``(output, target)`` and returns a scalar: the runtime calls it on the last
stage once per microbatch. The names are looked up here when ``PipelineConfig.loss_fn`` is a bare
name rather than a ``"module:attr"`` string, so a YAML file never needs to import code for the
common cases.

Token-normalised losses (docs/data.md, "The token-exact loss"). A loss that declares a keyword
parameter ``num_valid_tokens`` opts in: the pipeline counts the valid target tokens of the whole
step (every microbatch, every dp rank of ``dp_group``) once before the schedule runs and calls
``loss_fn(output, target, num_valid_tokens=N)``; the loss returns the *sum* of its per-token
losses over the microbatch divided by ``N`` - the microbatch's share of the step's loss, as
Hugging Face's ``num_items_in_batch``. Valid tokens are counted by the loss's
``count_valid_tokens(target)`` attribute when it has one, else by :func:`count_valid_tokens`
(target entries ``!= -100``). Called with two arguments such a loss is the plain per-microbatch
mean it always was. ``cross_entropy`` is one.
"""

from __future__ import annotations

import inspect
from typing import Callable

from pp_core.callables import resolve_callable
from pp_core.errors import ConfigError, did_you_mean

__all__ = ["cross_entropy", "mse", "l1", "BUILTIN_LOSSES", "get_loss", "resolve_loss",
           "pop_aux_losses", "IGNORE_INDEX",
           "count_valid_tokens", "counts_tokens", "token_counter"]

IGNORE_INDEX = -100
"""A target entry equal to this is not a token the loss counts (torch's and HF's convention)."""


def cross_entropy(output, target, *, num_valid_tokens=None):
    """Cross entropy of ``[..., C]`` logits against ``[...]`` integer class targets; targets equal
    to ``-100`` are ignored.

    Language models produce ``[batch, seq, vocab]`` logits and ``[batch, seq]`` targets; both are
    flattened so torch's ``cross_entropy`` sees ``[N, C]`` against ``[N]``. Without
    ``num_valid_tokens``: the mean over the valid targets; with it (the pipeline passes the
    step's count): their sum divided by it.
    """
    import torch.nn.functional as functional  # lazy: torch, the core loads no torch

    logits, labels = output.reshape(-1, output.shape[-1]).float(), target.reshape(-1)
    if num_valid_tokens is None:
        return functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    total = functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / num_valid_tokens


def count_valid_tokens(target):
    """The number of entries ``!= -100`` in the first tensor of ``target`` (a 0-dim int tensor)."""
    import torch  # lazy: the core imports no torch at load

    tensor = target
    while isinstance(tensor, (tuple, list, dict)) and tensor:
        tensor = next(iter(tensor.values())) if isinstance(tensor, dict) else tensor[0]
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"count_valid_tokens: the target holds no tensor "
                        f"({type(target).__name__}); give the loss a count_valid_tokens(target)")
    return (tensor != IGNORE_INDEX).sum()


def counts_tokens(loss_fn) -> bool:
    """Whether ``loss_fn`` opts in to the step's token count (a ``num_valid_tokens`` parameter
    that can be passed by keyword)."""
    try:
        parameter = inspect.signature(loss_fn).parameters.get("num_valid_tokens")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return parameter is not None and parameter.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


def token_counter(loss_fn) -> Callable:
    """How ``loss_fn`` counts the valid tokens of a target: its ``count_valid_tokens``
    attribute, else :func:`count_valid_tokens`."""
    return getattr(loss_fn, "count_valid_tokens", None) or count_valid_tokens


def mse(output, target):
    """Mean squared error (regression); ``target`` is cast to the output's dtype."""
    import torch.nn.functional as functional  # lazy: torch, the core loads no torch

    return functional.mse_loss(output.float(), target.to(output.dtype).float())


def l1(output, target):
    """Mean absolute error."""
    import torch.nn.functional as functional  # lazy: torch, the core loads no torch

    return functional.l1_loss(output.float(), target.to(output.dtype).float())


BUILTIN_LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy, "mse": mse, "l1": l1}


def get_loss(name: str) -> Callable:
    """The built-in loss called ``name``; an unknown name lists the built-ins and the closest."""
    found = BUILTIN_LOSSES.get(str(name).lower())
    if found is not None:
        return found
    hint = did_you_mean(str(name).lower(), BUILTIN_LOSSES, after=" ")
    raise ConfigError(
        f"unknown loss {name!r}; {hint}built-in losses: {', '.join(BUILTIN_LOSSES)}; "
        f"or name your own as 'module:attr' (this imports that module)"
    )


def resolve_loss(value) -> Callable:
    """A loss callable from a callable, a built-in name, or a ``"module:attr"`` string."""
    if callable(value):
        return value
    if isinstance(value, str) and ":" not in value:
        return get_loss(value)
    return resolve_callable(value, "loss_fn")


# ----------------------------------------------------------------------------- auxiliary losses
# A layer's auxiliary loss (an MoE load-balancing loss) reaches its parameters through the
# layer's own backward, at the scale the running step gives it: pp_core.parallel.expert.aux_loss.


def pop_aux_losses(model_parts) -> list:
    """The auxiliary losses recorded by the modules of ``model_parts`` since the last call.

    A module that computes one keeps the detached values in a list attribute ``pp_aux_losses``
    (one per training forward); this returns them all and empties the lists (the metrics'
    ``aux_loss``)."""
    found = []
    for part in model_parts:
        for module in part.modules():
            values = getattr(module, "pp_aux_losses", None)
            if isinstance(values, list) and values:
                found += values
                module.pp_aux_losses = []
    return found
