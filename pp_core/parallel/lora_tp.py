"""Tensor parallelism of PEFT's LoRA layers: a plan entry that names a Linear also covers it once
``model.lora`` (``peft.get_peft_model``) has wrapped it.

PEFT replaces each adapted ``nn.Linear`` in place, under the same FQN, by a LoRA layer:
``base_layer`` (the Linear), ``lora_A.<adapter>`` (in -> r), ``lora_B.<adapter>`` (r -> out),
``lora_dropout.<adapter>`` and ``scaling``; its forward is ``base_layer(x) +
lora_B(lora_A(dropout(x))) * scaling``. A ``ColwiseParallel`` / ``RowwiseParallel`` (or a subclass:
its own partition and input/output functions, e.g. the demo GPT's strided ``qkv``) matched to such
a layer is applied to the whole layer (:func:`lora_style`), with the input prepared and the output
reduced once for base and adapter together:

* **column-wise** (output sharded): ``base_layer`` and ``lora_B`` sharded by the style (``lora_B``'s
  output is the sharded dimension), ``lora_A`` replicated. ``lora_A``'s output is a replicated
  DTensor into the sharded ``lora_B``, so DTensor makes its weight's gradient a partial sum over tp,
  which ``Pipeline.step`` reduces once per step (:func:`~pp_core.parallel.tensor_parallel.
  reduce_partial_gradients`), as for a sequence-parallel norm; no collective per microbatch.
* **row-wise** (input sharded): ``base_layer`` and ``lora_A`` sharded on their input dimension,
  ``lora_B`` replicated: ``lora_A``'s output is a partial sum, ``lora_B`` keeps it one, and the
  style's output function reduces base and adapter in one all-reduce (reduce-scatter with sequence
  parallelism); ``lora_B``'s gradient is then a partial sum reduced once per step.
* **dropout** > 0 (:class:`ShardedDropout`): each tp rank drops its own slice of the input's
  features (in a column-wise layer a slice of the replicated input; ``lora_A``'s output is then a
  partial sum, all-reduced: ``r`` numbers per token), so every feature is dropped by exactly one
  rank and no two ranks disagree on a mask. The masks come from a seed drawn from the default
  generator (activation checkpointing replays it) plus the tp rank.

Refused by :func:`adapter_problems` (one line each, naming the key and the fix): an adapted layer
the plan gives another style, an adapter on a sharded embedding, LoRA variants (DoRA), PEFT's
``modules_to_save`` copies of sharded modules, and an adapted layer the plan does not cover
beside layers it shards or under sequence parallelism (its adapter would see tp shards).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from pp_core.parallel.plans import matching_modules

__all__ = ["is_lora_layer", "is_peft_layer", "base_module", "style_side", "lora_style",
           "adapter_problems", "ShardedDropout"]


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (told apart by its parts, so that peft need not be imported)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and \
        isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and \
        isinstance(getattr(module, "lora_B", None), nn.ModuleDict)


def _is_saved_copy(module: nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper`` (``model.lora.modules_to_save``: a trained copy)."""
    return isinstance(getattr(module, "original_module", None), nn.Module) and \
        isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)


def is_peft_layer(module: nn.Module) -> bool:
    return is_lora_layer(module) or _is_saved_copy(module)


def base_module(module: nn.Module) -> nn.Module:
    """The module a LoRA layer wraps (its sizes are what a plan shards), else ``module``."""
    return module.base_layer if is_lora_layer(module) else module


def style_side(style) -> Optional[str]:
    """Which side of a Linear / Embedding a style shards: ``"out"`` (column-wise), ``"in"``
    (row-wise), or ``None`` (replicated weights, input/output preparation)."""
    from torch.distributed.tensor.parallel import (  # lazy: torch.distributed.tensor, seconds
        ColwiseParallel, RowwiseParallel)

    if isinstance(style, ColwiseParallel):
        return "out"
    if isinstance(style, RowwiseParallel):
        return "in"
    return None


def _variants(module: nn.Module) -> list[str]:
    """The LoRA variants of a layer's adapters (DoRA, ...): what plain sharding does not cover."""
    found = [type(v).__name__ for v in (getattr(module, "lora_variant", None) or {}).values()]
    if any((getattr(module, "use_dora", None) or {}).values()) and not found:
        found.append("DoRA")
    return found


def adapter_problems(model: nn.Module, plan: dict, key: str = "distributed.tp_size") -> list[str]:
    """What keeps ``plan`` from sharding ``model``'s PEFT layers (module docstring): one line per
    kind of problem, naming its layers."""
    from torch.distributed.tensor.parallel import SequenceParallel  # lazy: torch.distributed.tensor

    matched = {name: style for name, _, style in matching_modules(model, plan)}
    sharded = {name for name, style in matched.items() if style_side(style) is not None}
    sequence = any(isinstance(style, SequenceParallel) for style in plan.values())
    found: dict[str, list[str]] = {}  # a problem, its layers standing in as {names} / {short}
    for name, module in model.named_modules():
        if not is_peft_layer(module):
            continue
        style = matched.get(name)
        kind = type(style).__name__
        if style is None:
            parent = name.rpartition(".")[0]
            if any(n.rpartition(".")[0] == parent for n in sharded):
                found.setdefault("beside", []).append(name)
            elif sequence:
                found.setdefault("sequence", []).append(name)
        elif _is_saved_copy(module):
            found.setdefault("saved", []).append(name)
        elif style_side(style) is None:
            found.setdefault(f"style {kind}", []).append(name)
        elif not isinstance(module.base_layer, nn.Linear):
            found.setdefault(f"base {type(module.base_layer).__name__}", []).append(name)
        elif _variants(module):
            found.setdefault(f"variant {', '.join(_variants(module))}", []).append(name)
    return [_problem(what, names, key) for what, names in found.items()]


def _problem(what: str, names: list[str], key: str) -> str:
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    short = ", ".join(repr(n) for n in sorted({name.rsplit(".", 1)[-1] for name in names}))
    leave = f"leave {short} out of model.lora.target_modules, or set {key}: 1"
    kind, _, detail = what.partition(" ")
    if kind in ("beside", "sequence"):
        where = ("beside layers the plan shards" if kind == "beside" else
                 "under sequence parallelism (sequence shards)")
        return (f"{key}: model.lora trains {listed}, which the tensor-parallel plan does not "
                f"cover, {where}: the adapters would see tp-sharded activations; add them to the "
                f"plan (ColwiseParallel or RowwiseParallel), " + leave.replace(
                    "target_modules", "target_modules (or modules_to_save)"))
    if kind == "saved":
        return (f"{key}: model.lora.modules_to_save trains copies of {listed}, which the "
                f"tensor-parallel plan shards; pp-core does not shard PEFT's saved copies: leave "
                f"{short} out of model.lora.modules_to_save, or set {key}: 1")
    if kind == "style":
        return (f"{key}: model.lora adapts {listed}, which the tensor-parallel plan gives "
                f"{detail}; an adapted Linear is sharded as ColwiseParallel or RowwiseParallel "
                f"only: plan it so, or {leave}")
    if kind == "base":
        return (f"{key}: model.lora adapts {listed} ({detail}), which the tensor-parallel plan "
                f"shards; only adapters on nn.Linear layers are sharded: {leave}")
    return (f"{key}: model.lora adapts {listed} with {detail} (model.lora.use_dora or another "
            f"LoRA variant), which pp-core does not shard; use plain LoRA (use_dora: false), or "
            f"set {key}: 1")


def lora_style(module: nn.Module, style) -> Any:
    """The style to apply to ``module``: ``style`` itself, or for a LoRA layer planned column-
    or row-wise the style that shards it whole (module docstring)."""
    side = style_side(style) if is_lora_layer(module) else None
    return _lora_parallel()(style, side) if side is not None else style


@functools.lru_cache(maxsize=None)  # one class, so isinstance holds
def _lora_parallel():
    from torch.distributed.tensor import Shard, distribute_module  # lazy: seconds
    from torch.distributed.tensor.parallel import ParallelStyle

    from pp_core._torch_compat import linear_style_functions

    class LoraParallel(ParallelStyle):
        """``style`` (column- or row-wise) applied to a LoRA layer: base and one adapter
        sharded by the style, the other adapter replicated, one input and output preparation."""

        def __init__(self, style, side: str):
            super().__init__()
            self.style, self.side = style, side

        def _apply(self, module, device_mesh):
            style = self.style
            style.src_data_rank = self.src_data_rank
            desired = (Shard(-1),) if self.side == "in" else style.desired_input_layouts
            partition, input_fn, output_fn = linear_style_functions(style, desired)
            adapters = module.lora_B if self.side == "out" else module.lora_A
            targets = {id(module.base_layer)} | {id(linear) for linear in adapters.values()}

            def shard(name, child, mesh):
                if id(child) in targets:
                    partition(name, child, mesh)  # the rest: replicated by distribute_module

            for adapter, dropout in list(module.lora_dropout.items()):
                if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                    module.lora_dropout[adapter] = ShardedDropout(dropout.p).train(dropout.training)
                    if self.side == "out":  # the partial sum of lora_A into lora_B: reduced
                        module.lora_A[adapter].register_forward_hook(_replicated)
            return distribute_module(module, device_mesh, shard, input_fn, output_fn)

        def __repr__(self) -> str:
            return f"LoraParallel({self.style!r})"

    return LoraParallel


def _replicated(module, inputs, output):
    from torch.distributed.tensor import Replicate  # lazy: torch.distributed.tensor

    if any(p.is_partial() for p in output.placements):
        return output.redistribute(placements=[Replicate()] * len(output.placements))
    return output


class ShardedDropout(nn.Module):
    """PEFT's ``lora_dropout`` in a tensor-parallel LoRA layer: each tp rank drops its own slice
    of the (replicated or last-dimension-sharded) input's features and returns that slice as a
    ``Shard(-1)`` DTensor; the gradient of a replicated input is a partial sum (each rank's
    slice), summed with the base layer's by the input preparation's reduction."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Shard  # lazy: seconds, once

        if not self.training or not isinstance(x, DTensor):
            return nn.functional.dropout(x, self.p, self.training)
        mesh, dim = x.device_mesh, x.ndim - 1
        rank, size = mesh.get_local_rank(), mesh.size()
        placement = x.placements[0]
        if placement.is_replicate():
            local = x.to_local(grad_placements=[Partial()]).chunk(size, dim)[rank]
        elif isinstance(placement, Shard) and placement.dim % x.ndim == dim:
            local = x.to_local()
        else:
            raise ValueError(f"ShardedDropout: expected a replicated or last-dimension-sharded "
                             f"input, found {placement}")
        seed = int(torch.randint(2 ** 62, ())) + rank  # the default generator: replayed by AC
        generator = torch.Generator(local.device).manual_seed(seed)
        keep = torch.empty_like(local).bernoulli_(1 - self.p, generator=generator)
        dropped = local * keep / (1 - self.p) if self.p < 1 else local * 0
        return DTensor.from_local(dropped, mesh, [Shard(dim)],
                                  run_check=False, shape=x.shape, stride=x.stride())

    def extra_repr(self) -> str:
        return f"p={self.p}"
