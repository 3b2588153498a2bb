"""Runtime initializers: process-local resources a model needs ready before each microbatch.

A model owns resources that live outside its parameters — a rotary-embedding cache sized for the
longest sequence, a workspace for a fused kernel, a communication buffer. When a pipeline splits
the model, several stages on one rank may need the *same* resource; this module finds each one
exactly once and refuses conflicting demands before any pipeline traffic starts.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from pp_core.initializer import PipelineRuntimeInitializer
from pp_core.plugin_manager import Plugins, plugins_or_default

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PipelineRuntimeInitializer", "collect_pipeline_runtime_initializers",
           "summarize_runtime_initializers"]


def _check_plain(value, what: str, initializer, where: str, plugin: str) -> None:
    """``value`` can serve as a key or signature: hashable, and ``==`` answers True or False (a
    tensor is hashable, but its ``==`` answers a tensor, which no ``if`` can read)."""
    provider = (f"runtime initializer {type(initializer).__qualname__} from plugin {plugin!r} "
                f"for module {where}")
    fix = f"make {what} a tuple, string, number or frozen dataclass"
    try:
        hash(value)
    except Exception as exc:  # noqa: BLE001 - a __hash__ of the provider's that raises anything
        raise TypeError(f"{provider} has an unhashable {what} {_shown(value)} "
                        f"({type(exc).__name__}: {exc}); {fix}") from None
    same, why = _compare(value, value)
    if same is None:
        raise TypeError(f"{provider} has a {what} {_shown(value)} that cannot be compared "
                        f"({why}, not True or False); {fix} (e.g. tuple(t.tolist()) for a "
                        f"tensor)")


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's scalar bool


def _compare(first, second) -> tuple[bool | None, str]:
    """``(first == second, "")`` as a bool; ``(None, why)`` when the comparison raises or
    answers no bool (a tuple holding tensors equals itself, by identity, but not another)."""
    try:
        same = first == second
    except Exception as exc:  # noqa: BLE001 - e.g. a tuple holding tensors of the provider's
        return None, f"== raised {type(exc).__name__}"
    if not _is_bool(same):
        return None, f"== answered {type(same).__name__}"
    return bool(same), ""


def _shown(value) -> str:
    try:
        return repr(value)[:80]
    except Exception:  # noqa: BLE001 - a __repr__ that raises too
        return f"<{type(value).__qualname__}>"


def collect_pipeline_runtime_initializers(
    model_parts: "list[nn.Module]", plugins: "Plugins | None" = None
) -> "list[PipelineRuntimeInitializer]":
    """The initializers of every module of every part, one per ``resource_key``.

    Modules are visited part by part in ``named_modules()`` order. The first initializer of each
    key is kept; a later one with an equal signature is dropped; a later one with a different
    signature raises ``RuntimeError`` naming the key, both signatures and both modules. A key or
    signature that is not hashable raises ``TypeError`` naming the module and the provider.
    Nothing is prepared here.
    """
    plugins = plugins_or_default(plugins)
    kept: dict = {}
    order: list[PipelineRuntimeInitializer] = []
    for part_index, part in enumerate(model_parts):
        for fqn, module in part.named_modules():
            where = f"{fqn or '<root>'!r} of model part {part_index} ({type(module).__name__})"
            for plugin, initializer in plugins.runtime_initializers(module):
                key = getattr(initializer, "resource_key", None)
                signature = getattr(initializer, "signature", None)
                _check_plain(key, "resource_key", initializer, where, plugin)
                _check_plain(signature, "signature", initializer, where, plugin)
                if key not in kept:
                    kept[key] = (initializer, where)
                    order.append(initializer)
                    continue
                first, first_where = kept[key]
                equal, why = _compare(first.signature, signature)
                if equal is None:
                    raise RuntimeError(
                        f"runtime resource {key!r} is requested with signatures that cannot be "
                        f"compared: {_shown(first.signature)} by module {first_where} and "
                        f"{_shown(signature)} by module {where} ({why}); "
                        f"every module sharing a resource_key must expect the same "
                        f"configuration: make the signatures plain values (tuples, strings, "
                        f"numbers) that compare equal")
                if not equal:
                    raise RuntimeError(
                        f"runtime resource {key!r} is requested with two different signatures: "
                        f"{first.signature!r} by module {first_where} and {signature!r} by module "
                        f"{where}; every module sharing a resource_key must expect the same "
                        f"configuration, so give the resources different keys or make their "
                        f"configurations equal"
                    )
    return order


def summarize_runtime_initializers(model_parts: "list[nn.Module]", plugins: "Plugins | None" = None
                                   ) -> "list[tuple[Hashable, Hashable, int]]":
    """``(resource_key, signature, modules)`` of each initializer the collector keeps for these
    parts, in its order, with how many modules asked for that key (``pp-core validate`` prints
    it per stage). Conflicts raise as in :func:`collect_pipeline_runtime_initializers`."""
    plugins = plugins_or_default(plugins)
    kept = collect_pipeline_runtime_initializers(model_parts, plugins)
    counts: dict = {}
    for part in model_parts:
        for _, module in part.named_modules():
            keys = {getattr(i, "resource_key", None)
                    for _, i in plugins.runtime_initializers(module)}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
    return [(i.resource_key, i.signature, counts.get(i.resource_key, 0)) for i in kept]
