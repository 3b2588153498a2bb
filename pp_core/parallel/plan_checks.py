"""Tensor- and expert-parallel plans that must do something, checked before any process starts.

A plan is ``{module pattern: style}`` from a plugin hook (``pp_tensor_parallel_plan``,
``pp_expert_parallel_plan``). What went through unnoticed: a hook returning a list, an int or int
keys (a raw traceback), a style that is a string (``"colwise"``) or not a torch ``ParallelStyle``,
a column-/row-wise style on a module torch cannot shard that way (a ``LayerNorm``), and a plan
that matches no module of a stage that has parameters: its tp ranks then each compute the whole
stage, two processes doing one process's work, rc 0. Each is one line naming the YAML key, the
plugin that gave the plan and the fix. Pure checks over the (meta) model and the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from pp_core.errors import PluginError, shorten

__all__ = ["plan_provider", "call_plan_hook", "plan_problems", "unmatched_parts"]

_HOOK_KEY = {"pp_tensor_parallel_plan": "distributed.tp_size",
             "pp_expert_parallel_plan": "distributed.ep_size"}


def plan_provider(plugins, hook: str, **kwargs) -> str:
    """``plugin 'p' (pp-p 1.0)``: the plugin whose ``hook`` implementation answers ``kwargs``
    first (a non-``None`` result, or an exception), as pluggy's first-result call would."""
    return plugins.first_answerer(hook, **kwargs)


def call_plan_hook(plugins, hook: str, **kwargs) -> Any:
    """The first result of ``hook`` through the facade; a plugin that raised is named (the
    facade's :class:`PluginError`) after the YAML key the plan serves."""
    try:
        return plugins.first_answer(hook, **kwargs)
    except PluginError as exc:
        raise PluginError(f"{_HOOK_KEY.get(hook, 'distributed')}: {exc}") from exc


def _is_tp_style(style) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle  # lazy: torch.distributed, secs

    return isinstance(style, ParallelStyle)


def _is_ep_style(style) -> bool:
    return callable(getattr(style, "apply", None))


def plan_problems(plan, hook: str, provider: Callable[[], str], model=None) -> list[str]:
    """What makes ``plan`` (the result of ``hook``) no plan: not a dict, keys that are not module
    paths, styles that are not styles, a column-/row-wise style on a module other than a
    ``Linear`` or ``Embedding`` of ``model``."""
    key = _HOOK_KEY.get(hook, "distributed")
    tensor = hook == "pp_tensor_parallel_plan"
    wanted = ("a torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), SequenceParallel(), "
              "...)") if tensor else "an expert-parallel style (an object with apply(module, " \
                                     "ep_group))"
    if not isinstance(plan, Mapping):
        return [f"{key}: {provider()} returned {type(plan).__name__} "
                f"{shorten(repr(plan), 60)} from {hook}, expected a dict {{module pattern: "
                f"style}}; return e.g. {{'layers.*.attn': ...}}"]
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            return [f"{key}: {provider()}'s {hook} plan has the key {pattern!r} "
                    f"({type(pattern).__name__}), expected a module path such as 'layers.*.mlp'"]
        if not (_is_tp_style(style) if tensor else _is_ep_style(style)):
            hint = " (a string names no style)" if isinstance(style, str) else ""
            return [f"{key}: {provider()}'s {hook} plan maps {pattern!r} to "
                    f"{shorten(repr(style), 60)}{hint}, expected {wanted}"]
    if tensor and model is not None:
        return _style_mismatches(model, plan, key, provider)
    return []


def _style_mismatches(model, plan, key: str, provider) -> list[str]:
    from torch import nn  # lazy: torch, with a model in hand
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pp_core.parallel.lora_tp import base_module, is_peft_layer
    from pp_core.parallel.tensor_parallel import plan_modules

    for name, module, style in plan_modules(model, plan):
        # a PEFT layer: its base's kind; what else keeps it from sharding is adapter_problems'
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not is_peft_layer(module) \
                and not isinstance(base_module(module), (nn.Linear, nn.Embedding)):
            return [f"{key}: {provider()}'s plan shards {name!r} ({type(module).__name__}) with "
                    f"{type(style).__name__}, which torch applies only to nn.Linear and "
                    f"nn.Embedding; use SequenceParallel() for a norm, or leave it out of the "
                    f"plan (replicated)"]
    return []


def unmatched_parts(parts, plan_of: Callable, provider: Callable[[], str]) -> list[str]:
    """Stages that hold parameters but none of which the plan shards (``parts``: ``[(stage,
    part)]``; ``plan_of(part)``: the plan the runtime applies to it)."""
    from pp_core.parallel.tensor_parallel import plan_modules  # lazy: torch

    idle = []
    for stage, part in parts:
        count = sum(p.numel() for p in part.parameters())
        plan = plan_of(part)
        if count and isinstance(plan, Mapping) and not plan_modules(part, plan):
            idle.append((stage, count))
    if not idle:
        return []
    stages = ", ".join(f"{stage} ({count:,} parameters)" for stage, count in idle)
    return [f"distributed.tp_size: the tensor-parallel plan of {provider()} matches no module of "
            f"stage(s) {stages}: their tp ranks would each compute the whole stage, the same work "
            f"twice; make the plan's module paths match the model's (e.g. 'layers.*.attn.q'), or "
            f"set distributed.tp_size: 1"]
