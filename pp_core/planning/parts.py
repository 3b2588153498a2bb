"""Build this rank's model parts from a :class:`~pp_core.planning.split.SplitPlan`, without copies.

A part is the model with every module another stage owns pruned away: the kept modules are the
*same objects* as in the model (their parameters are shared, never copied), and each module on
the path from the root to a kept one is a shallow copy whose ``_modules`` / ``_parameters``
dicts are pruned. So a part's ``state_dict()`` keys are exactly the model's keys for what it
holds, and building every part of a rank costs a few module objects, not a model copy.

Pruning rules (the ``layers`` contract, docs/splitting.md "The forward contract"):
- a child of a container (``ModuleList``, ``ModuleDict``, ``Sequential``, ``ParameterList``,
  ``ParameterDict``) that the stage does not hold is removed; the others keep their original
  keys, so iterating the container yields the stage's blocks in order;
- an absent ``ModuleList`` / ``ModuleDict`` (a stage with none of the blocks) is kept empty, so
  iterating it yields nothing; any other absent child module, or absent parameter, is set to
  ``None`` (``self.norm is None``);
- buffers of a module on the path are kept (shared tensors, e.g. a rotary table on the root).

A model built on the meta device is materialised part by part (``device=``): only this rank's
modules get storage, then they are initialised (see :func:`materialize_parts`).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from pp_core.errors import ConfigError, PluginError
from pp_core.plugin_manager import plugins_or_default

__all__ = ["build_model_parts", "prune_model", "materialize_parts", "shared_parameter_stages",
           "mark_shared_parameters"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing every attribute value, with its own dicts and sets.

    Own dicts matter: ``_modules``/``_parameters`` are pruned per part, and hook dicts must not
    be shared, or a hook registered on one part's root would fire on another's.
    """
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    return new


def _emptied(container: nn.Module) -> nn.Module:
    """``container`` without its entries: a stage holding none of ``layers`` (only the embedding
    or only the head) still runs ``for layer in self.layers`` - over nothing."""
    new = _shallow(container)
    new._modules.clear()
    return new


def prune_model(model: nn.Module, fqns: Sequence[str]) -> nn.Module:
    """The part of ``model`` that holds exactly ``fqns`` (module, parameter or buffer names)."""
    keep = set(fqns)
    on_path = {""}
    for fqn in keep:
        pieces = fqn.split(".")
        on_path.update(".".join(pieces[:end]) for end in range(1, len(pieces)))

    def prune(module: nn.Module, prefix: str) -> nn.Module:
        new = _shallow(module)
        container = isinstance(module, _CONTAINERS)
        for name, child in module._modules.items():
            fqn = f"{prefix}{name}"
            if child is None or fqn in keep:
                continue
            if fqn in on_path:
                new._modules[name] = prune(child, fqn + ".")
            elif container:
                del new._modules[name]
            elif isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                new._modules[name] = _emptied(child)  # a forward iterates it; nothing to call
            else:
                new._modules[name] = None
        for name, param in module._parameters.items():
            if param is not None and f"{prefix}{name}" not in keep:
                if container:
                    del new._parameters[name]
                else:
                    new._parameters[name] = None
        return new

    return prune(model, "")


def _tie_groups(modules: Sequence[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[int] = set()
    for root in modules:
        for sub in root.modules():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            for name, param in sub._parameters.items():
                if param is not None:
                    groups.setdefault(id(param), []).append((sub, name))
    return [group for group in groups.values() if len(group) > 1]


def materialize_parts(parts: Sequence[nn.Module], device, init_fn: Optional[Callable] = None):
    """Give meta-device parts real storage on ``device`` and initialise them, in place.

    Only these parts' meta tensors get storage (uninitialised, as with ``to_empty``); a
    parameter shared by several modules (a tied embedding and head, also across two parts of
    this rank) stays shared.
    Initialisation, per part: ``init_fn(part)`` when given; else the part's ``init_weights()``
    when the model class defines one (torchtitan style; it must skip ``None`` modules and must
    refill buffers such as rotary tables); else ``reset_parameters()`` of every submodule that
    has one (torch's default init). Values differ from a model initialised in one piece unless
    the init is deterministic per module; load a checkpoint after building for that.
    """
    ties = _tie_groups(parts)

    def empty(tensor):  # a module shared by two parts must not be emptied twice
        return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor

    for part in parts:
        part._apply(empty)
    for group in ties:
        first_module, first_name = group[0]
        shared = first_module._parameters[first_name]
        for module, name in group[1:]:
            module._parameters[name] = shared
    for part in parts:
        if init_fn is not None:
            init_fn(part)
        elif callable(getattr(part, "init_weights", None)):
            part.init_weights()
        else:
            for sub in part.modules():
                if callable(getattr(sub, "reset_parameters", None)):
                    sub.reset_parameters()
    return list(parts)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _holds(fqns: Sequence[str], name: str) -> bool:
    return any(name == fqn or name.startswith(fqn + ".") for fqn in fqns)


def shared_parameter_stages(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]
                            ) -> dict[int, tuple[tuple[str, ...], tuple[int, ...]]]:
    """``{id(tensor): (every name of it, stages holding it)}`` for each parameter of ``model``
    that more than one stage holds (a stage holds a name it lists, or a module above it)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    shared = {}
    for key, names in by_tensor.items():
        stages = tuple(s for s, fqns in enumerate(fqns_per_stage)
                       if any(_holds(fqns, n) for n in names))
        if len(stages) > 1:
            shared[key] = (tuple(names), stages)
    return shared


def mark_shared_parameters(part: nn.Module, stage: int, shared: dict) -> None:
    """Record on ``part`` (stage ``stage``) every weight other stages hold too.

    The part keeps the model's tensor (parts of one rank share it, so its gradient already sums
    their uses; other ranks hold their own copy of the model): ``pp_tied_parameters``
    (``{local name: every name of the weight}``) and ``pp_tied_stages`` (``{names: stages}``)
    tell ``Pipeline.step`` to sum the gradient over the ranks holding it
    (:mod:`pp_core.parallel.tied`). Names the part already records (a splitter that unties its
    own weights, e.g. ``hf_decoder``) are left alone.
    """
    tied = dict(getattr(part, "pp_tied_parameters", {}) or {})
    holders = dict(getattr(part, "pp_tied_stages", {}) or {})
    by_name = {name: key for key, (names, _) in shared.items() for name in names}
    for name, param in part.named_parameters(remove_duplicate=False):
        if name in tied:
            continue
        if id(param) not in shared:
            if name in by_name:  # a splitter copied a shared weight and did not say so
                raise PluginError(
                    f"stage {stage} holds its own copy of {name!r}, a weight stages "
                    f"{list(shared[by_name[name]][1])} share, without recording it in "
                    f"part.pp_tied_parameters; its gradient could not be summed over the "
                    f"stages, so the splitter must keep the model's tensor or record the copy "
                    f"(see pp_core.parallel.tied)")
            continue
        names, stages = shared[id(param)]
        tied[name] = names
        holders[names] = stages
    if tied:
        part.pp_tied_parameters = tied
        part.pp_tied_stages = holders


def build_model_parts(
    model: nn.Module,
    plan,
    stage_indices: Sequence[int],
    config=None,
    *,
    device=None,
    init_fn: Optional[Callable] = None,
) -> list[nn.Module]:
    """This rank's model parts, one per entry of ``stage_indices`` and in that order.

    A splitter with ``make_part(model, fqns, stage_index, num_stages, config)`` builds its parts
    itself; otherwise :func:`prune_model` does. A weight held by several stages is recorded
    (:func:`mark_shared_parameters`): ``Pipeline.step`` sums its gradient over the ranks. When ``device`` is given and a part still has
    meta tensors, the part is materialised there (:func:`materialize_parts`); the parts are not
    moved or cast otherwise (the runtime does that, for this rank's parts only).
    """
    indices = list(stage_indices)
    bad = [i for i in indices if not isinstance(i, int) or not 0 <= i < plan.num_stages]
    if bad or len(set(indices)) != len(indices):
        raise ConfigError(f"stage_indices={indices} must be distinct ints in [0, "
                          f"{plan.num_stages}) for a plan of {plan.num_stages} stages")
    splitter = plan.splitter_object
    if splitter is None:
        splitter = plugins_or_default().splitters.get(plan.splitter)
    make_part = getattr(splitter, "make_part", None)
    model_keys = set(model.state_dict().keys()) if make_part is not None else set()
    shared = shared_parameter_stages(model, plan.fqns_per_stage)
    parts = []
    for index in indices:
        fqns = plan.fqns_per_stage[index]
        if make_part is None:
            part = prune_model(model, fqns)
        else:
            part = make_part(model, fqns, index, plan.num_stages, config)
            extra = sorted(set(part.state_dict().keys()) - model_keys)
            if extra:
                raise PluginError(
                    f"splitter {plan.splitter!r} built stage {index} with state_dict keys the "
                    f"model does not have: {extra[:5]}; a part must keep the model's names")
        if shared:  # a weight several stages hold: gradients summed (pp_core.parallel.tied)
            mark_shared_parameters(part, index, shared)
        parts.append(part)
    if device is not None and any(_on_meta(part) for part in parts):
        materialize_parts(parts, device, init_fn)
    return parts
