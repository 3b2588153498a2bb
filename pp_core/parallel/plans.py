"""What TP and EP plans share: one module matcher, one meaning of ``*``, one rule for parts.

A plan (tensor-parallel or expert-parallel) is ``{module pattern: style}``, patterns relative to
the model (or a model part: same class and FQNs). A pattern matches a module's FQN segment by
segment, so ``*`` (``fnmatch``) matches exactly one name: ``layers.*.moe`` matches
``layers.3.moe`` and never ``layers.3.block.moe``. A module two patterns match takes the first.

The rule for parts: each part asks for its own plan; a part without one (the hook passed, e.g. a
stage holding no MoE layer) is left alone, and no plan for any part is refused by the caller.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Callable, Optional

from torch import nn

__all__ = ["matching_modules", "plans_of_parts"]


def matching_modules(model: nn.Module, plan: dict) -> list[tuple[str, nn.Module, Any]]:
    """``[(fqn, module, style)]`` for every module of ``model`` a pattern of ``plan`` matches,
    in plan order (modules in traversal order under each pattern), each module once."""
    modules = [(name, name.split(".") if name else [], module)
               for name, module in model.named_modules()]
    found, seen = [], set()
    for pattern, style in plan.items():
        parts = pattern.split(".")
        for name, names, module in modules:
            if name not in seen and len(names) == len(parts) and \
                    all(fnmatchcase(n, p) for n, p in zip(names, parts)):
                seen.add(name)
                found.append((name, module, style))
    return found


def plans_of_parts(model_parts, plan: Optional[dict],
                   ask: Callable[[nn.Module], Optional[dict]]) -> list[tuple[nn.Module, dict]]:
    """``[(part, its plan)]`` for the parts that have one: ``plan`` for every part when given,
    else ``ask(part)`` (the plan hook, through the plugin facade); a part ``ask`` passes on is
    left out. The caller refuses an empty answer."""
    parts = getattr(model_parts, "model_parts", model_parts)
    found = []
    for part in parts:
        part_plan = dict(plan) if plan is not None else ask(part)
        if part_plan is not None:
            found.append((part, dict(part_plan)))
    return found
