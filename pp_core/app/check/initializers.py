"""Runtime initializers as the ranks collect them: per rank, over that rank's own stages.

Each rank collects the initializers of *its* model parts (one process, one set of resources), so a
``resource_key`` asked with two signatures is a conflict only between stages of one rank: two
ranks own two resources. :func:`stage_initializers` plans every rank's parts on the meta model and
collects as that rank will (what ``pp-core validate`` prints is per stage);
:func:`initializers_to_prepare` lists each distinct initializer of the model once, for validate to
``prepare()`` one microbatch as the executor does. A provider's fault (a hook or a model's own
method that raises or returns something else than initializers) is one line blaming it.
"""

from __future__ import annotations

from pp_core.errors import PluginError, PPCoreError, shorten
from pp_core.runtime.initializers import (collect_pipeline_runtime_initializers,
                                          summarize_runtime_initializers)

__all__ = ["stage_initializers", "initializers_to_prepare"]

def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shorten(str(exc))}"


def _meta_limit(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or \
        (isinstance(exc, RuntimeError) and "meta" in str(exc).lower())


def stage_initializers(model, split, schedule, config, plugins, problems: list[str]):
    """Per stage, ``[(resource_key, signature, modules)]`` of the initializers its part collects,
    after checking each rank's parts together as that rank collects them; ``None`` when the split
    was not planned or a part cannot be built on the meta device."""
    from pp_core.planning.parts import build_model_parts  # lazy: torch, with a model in hand

    if model is None or split is None:
        return None
    rank, stages = None, []
    try:
        for rank in range(schedule.num_ranks if schedule is not None else 0):
            stages = list(schedule.stages_of(rank))
            if len(stages) > 1:  # one stage per rank: the per-stage pass below is the rank's
                parts = build_model_parts(model, split, stages, config)
                collect_pipeline_runtime_initializers(parts, plugins)
        rank = None
        found = []
        for stage in range(split.num_stages):
            (part,) = build_model_parts(model, split, [stage], config)
            found.append(summarize_runtime_initializers([part], plugins))
        return found
    except PluginError as exc:  # a hook, or a model's own method, at fault: it is named
        problems.append(f"model: {exc}")
    except TypeError as exc:  # a key or signature that cannot be hashed: names its provider
        problems.append(f"model: {exc}")
    except RuntimeError as exc:
        if _meta_limit(exc):
            return None
        where = "a stage" if rank is None else \
            f"rank {rank}, which runs stages {', '.join(map(str, stages))} in one process,"
        problems.append(f"model: the runtime initializers of {where} disagree: {exc}")
    except Exception as exc:  # noqa: BLE001 - a part the meta device cannot build
        if not _meta_limit(exc) and not isinstance(exc, PPCoreError):
            raise
    return None


def initializers_to_prepare(model, plugins, problems: list[str]):
    """Each distinct initializer (by ``resource_key`` and ``signature``) of the model's modules,
    in traversal order, or ``None`` with a problem blaming its provider."""
    found, seen = [], set()
    try:
        for fqn, module in model.named_modules():
            for _, initializer in plugins.runtime_initializers(module):
                pair = (initializer.resource_key, initializer.signature)
                try:
                    if pair in seen:
                        continue
                    seen.add(pair)
                except Exception:  # noqa: BLE001 - not hashable: the stage check names it
                    pass
                found.append(initializer)
    except PluginError as exc:
        problems.append(f"model: {exc}")
        return None
    return found
