"""The ``layers`` splitter: a transformer-style model with a ``layers`` ModuleList/ModuleDict.

    class Transformer(nn.Module):        # children in registration order
        tok_embeddings  -> first stage   (every child registered before `layers`)
        layers[0..L-1]  -> spread over the stages, in order
        norm, output    -> last stage    (every child registered after `layers`)

Parameters and buffers set directly on the root follow the same rule as the root's forward
would need them least surprisingly: root parameters go to the first stage (a ``None`` elsewhere);
root buffers stay on every stage (shared, e.g. a rotary table). Layers are spread evenly,
counts differing by at most one, the extra layers going to the interior stages first (the first
and last stages already carry the embedding and the head); ``layers_per_stage`` only fixes how
many stages there are (``ceil(L / layers_per_stage)``, see ``pp_core.planning.split``).

The contract the model's forward must meet on a part is in ``docs/splitting.md``: skip ``None``
modules, and iterate ``self.layers`` (ModuleList) or ``self.layers.values()`` (ModuleDict).
"""

from __future__ import annotations

from pp_core import ConfigError, hookimpl
from pp_core.planning.partition import spread_between

__all__ = ["LayersSplitter"]


def _layers(model):
    from torch import nn  # lazy: loading the plugin must not import torch

    layers = getattr(model, "_modules", {}).get("layers")
    return layers if isinstance(layers, (nn.ModuleList, nn.ModuleDict)) else None


class LayersSplitter:
    """Embedding on the first stage, head on the last, blocks spread evenly in between."""

    name = "layers"
    priority = 200

    def accepts(self, model) -> bool:
        layers = _layers(model)
        return layers is not None and len(layers) > 0

    def rejection(self, model) -> str:
        if _layers(model) is None:
            return "no `layers` child that is an nn.ModuleList or nn.ModuleDict"
        return "its `layers` is empty"

    def num_layers(self, model) -> int:
        return len(_layers(model))

    def units(self, model) -> list[tuple[str, ...]]:
        """The pieces a cost-balanced split moves (``pp_core.planning.units``): the modules
        before ``layers`` (with the root's parameters), each block, the modules after."""
        before, keys, after = _pieces(model)
        blocks = [(f"layers.{key}",) for key in keys]
        return ([tuple(before)] if before else []) + blocks + ([tuple(after)] if after else [])

    def split(self, model, num_stages, config) -> list[list[str]]:
        if config is not None and config.module_fqns_per_model_part is not None:
            raise ConfigError("module_fqns_per_model_part is set, which splitter 'layers' does "
                              "not read; use splitter 'fqn' (the default when it is set)")
        before, keys, after = _pieces(model)
        if len(keys) < num_stages:
            raise ConfigError(
                f"model has {len(keys)} layers, cannot give {num_stages} stages at least one "
                f"each; use at most {len(keys)} stages (fewer ranks or stages per rank)")
        return spread_between(before, [f"layers.{key}" for key in keys], after, num_stages)


def _pieces(model) -> tuple[list[str], list[str], list[str]]:
    """``(before, layer keys, after)``: children before ``layers`` plus root parameters, the
    keys of the blocks, children after ``layers``."""
    keys = [key for key, block in _layers(model)._modules.items() if block is not None]
    before, after, seen = [], [], False
    for name, child in model._modules.items():
        if name == "layers":
            seen = True
        elif child is not None:
            (after if seen else before).append(name)
    before += [name for name, p in model._parameters.items() if p is not None]
    return before, keys, after


@hookimpl
def pp_register_splitters(register):
    register("layers", LayersSplitter())
