"""The ``sequential`` splitter: a chain of modules, cut where the parameter counts balance.

Accepted (the rule that makes it safe, since a forward is never inspected):
- a plain ``nn.Sequential`` (or a subclass that keeps ``nn.Sequential.forward``), or
- a model that declares ``pp_sequential = True``: its forward is exactly
  ``for child in children: x = child(x)`` over its children in registration order, and it holds
  no parameter of its own. Its parts are ``nn.Sequential``s of the kept children under their
  original names, so the model's own forward is not needed.

The children are cut into contiguous stages minimising the largest stage's parameter count
(``pp_core.planning.split.balanced_partition``); with ``layers_per_stage`` they are spread by
count instead (``spread``), each child counting as one layer. Values crossing a cut are what
the child before it returns: one tensor, since ``nn.Sequential`` passes one value along.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from pp_core import ConfigError, hookimpl
from pp_core.planning.split import balanced_partition, spread

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SequentialSplitter"]


def _is_plain_sequential(model) -> bool:
    from torch import nn  # lazy: loading the plugin must not import torch

    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


def _declared(model) -> bool:
    return getattr(model, "pp_sequential", False) is True


def _children(model) -> list[tuple[str, nn.Module]]:
    return [(name, child) for name, child in model._modules.items() if child is not None]


def _unique_numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


class SequentialSplitter:
    """Contiguous runs of an ``nn.Sequential``'s children, balanced by parameter count."""

    name = "sequential"
    priority = 100

    def accepts(self, model) -> bool:
        if not (_is_plain_sequential(model) or _declared(model)):
            return False
        own = any(p is not None for p in model._parameters.values())
        return not own and len(_children(model)) > 0

    def rejection(self, model) -> str:
        if not (_is_plain_sequential(model) or _declared(model)):
            return ("not an nn.Sequential (with nn.Sequential's forward), and no "
                    "`pp_sequential = True` declared")
        if any(p is not None for p in model._parameters.values()):
            return "it holds parameters of its own, outside its children"
        return "it has no children"

    def num_layers(self, model) -> int:
        return len(_children(model))

    def units(self, model) -> list[tuple[str, ...]]:
        """Each child is a unit of a cost-balanced split (``pp_core.planning.units``)."""
        return [(name,) for name, _ in _children(model)]

    def split(self, model, num_stages, config) -> list[list[str]]:
        if config is not None and config.module_fqns_per_model_part is not None:
            raise ConfigError("module_fqns_per_model_part is set, which splitter 'sequential' "
                              "does not read; use splitter 'fqn' (the default when it is set)")
        children = _children(model)
        if len(children) < num_stages:
            raise ConfigError(
                f"{type(model).__name__} has {len(children)} children, cannot give "
                f"{num_stages} stages at least one each; use at most {len(children)} stages")
        if config is not None and config.layers_per_stage is not None:
            counts = spread(len(children), num_stages)
        else:
            counts = balanced_partition([_unique_numel(c) for _, c in children], num_stages)
        stages, start = [], 0
        for count in counts:
            stages.append([name for name, _ in children[start:start + count]])
            start += count
        return stages

    def make_part(self, model, fqns, stage_index, num_stages, config) -> nn.Module:
        """An ``nn.Sequential`` of the stage's children, under their original names (shared)."""
        if _is_plain_sequential(model):
            from pp_core.planning.parts import prune_model  # lazy: torch, not at plugin load

            return prune_model(model, fqns)
        from torch import nn  # lazy: loading the plugin must not import torch

        return nn.Sequential(OrderedDict((name, model._modules[name]) for name in fqns))


@hookimpl
def pp_register_splitters(register):
    register("sequential", SequentialSplitter())
