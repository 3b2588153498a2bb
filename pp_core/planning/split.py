"""Plan how a model is cut into pipeline stages: which splitter, how many stages, which modules.

The plan is pure bookkeeping (module names per stage), kept apart from the code that builds the
parts (:mod:`pp_core.planning.parts`) so every rank can compute the same plan cheaply, check it,
and only then build its own parts. Everything here raises :class:`~pp_core.ConfigError` with the
offending values and the fix *before* any process group traffic. See ``docs/splitting.md``.
The stage-count arithmetic (:func:`spread`, :func:`balanced_partition`, :func:`virtual_stages`)
lives in :mod:`pp_core.planning.partition` and is re-exported here.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from pp_core.errors import ConfigError, PluginError, did_you_mean
from pp_core.planning.partition import balanced_partition, spread, virtual_stages  # re-exported
from pp_core.plugin_faults import plugin_call
from pp_core.plugin_manager import plugins_or_default

logger = logging.getLogger(__name__)

__all__ = [
    "SplitPlan",
    "plan_split",
    "select_splitter",
    "virtual_stages",
    "spread",
    "balanced_partition",
    "check_stage_fqns",
    "DEFAULT_PRIORITY",
]

DEFAULT_PRIORITY = 0
"""Priority of a splitter without a ``priority`` attribute (the built-ins use 100, 200, 300)."""


@dataclass
class SplitPlan:
    """Which modules each stage holds. The same on every rank; computed before any traffic.

    ``stages_per_rank`` is what the runtime must build its schedule with: it differs from the
    schedule's default when ``layers_per_stage`` or ``module_fqns_per_model_part`` fix the stage
    count. ``tied_parameters`` lists the names of each parameter held by several stages (a tied
    embedding and output head, one module used at two places, a module named in several parts):
    each holder gets its own copy and ``Pipeline.step`` sums their gradients.
    """

    num_stages: int
    fqns_per_stage: list[list[str]]
    splitter: str
    num_ranks: int = 1
    stages_per_rank: int = 1
    param_counts: list[int] = field(default_factory=list)
    tied_parameters: list[tuple[str, ...]] = field(default_factory=list)
    splitter_object: Any = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """One line per stage: index, parameter count, module names."""
        lines = [f"{self.num_stages} stages ({self.num_ranks} ranks x {self.stages_per_rank}), "
                 f"splitter {self.splitter!r}"]
        for index, fqns in enumerate(self.fqns_per_stage):
            count = self.param_counts[index] if index < len(self.param_counts) else "?"
            shown = ", ".join(fqns[:6]) + (f", ... (+{len(fqns) - 6})" if len(fqns) > 6 else "")
            lines.append(f"  stage {index}: {count} params: {shown}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- selection


def splitter_origin(name: str, plugins=None) -> str:
    """``splitter 'x' from plugin 'p' (pp-p 1.0)``: who to blame for a call into a splitter."""
    plugins = plugins_or_default(plugins)
    if name not in plugins.splitters:
        return f"splitter {name!r}"
    return plugins.origin("splitter", name)


def _check_methods(splitter, origin: str) -> None:
    if not callable(getattr(splitter, "split", None)):
        raise PluginError(f"{origin} has no split(model, num_stages, config) method (it is a "
                          f"{type(splitter).__name__}); a splitter needs one (docs/splitting.md)")


def _accepts(splitter, model, config, origin: str = "splitter") -> bool:
    _check_methods(splitter, origin)
    accepts = getattr(splitter, "accepts", None)
    if accepts is None:
        return True
    try:
        wants_config = len(inspect.signature(accepts).parameters) >= 2
    except (TypeError, ValueError):
        wants_config = False
    args = (model, config) if wants_config else (model,)
    return bool(plugin_call(origin, "accepts()", accepts, *args))


def _rejection(splitter, model, origin: str = "splitter") -> str:
    reason = getattr(splitter, "rejection", None)
    return plugin_call(origin, "rejection()", reason, model) if callable(reason) else \
        "does not accept it"


def _priority(splitter) -> float:
    value = getattr(splitter, "priority", DEFAULT_PRIORITY)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else \
        DEFAULT_PRIORITY


def select_splitter(model, config, plugins=None, splitter=None) -> tuple[str, Any]:
    """``(name, splitter)``: the one named (a registry name or an object), else automatic.

    Automatic: registered splitters sorted by their ``priority`` attribute, highest first (ties:
    registration order); the first whose ``accepts(model)`` (or ``accepts(model, config)``) is
    true wins. Built-ins: ``fqn`` 300 (only when ``module_fqns_per_model_part`` is set),
    ``layers`` 200, ``sequential`` 100; a splitter without ``priority`` has 0.
    """
    if splitter is not None and not isinstance(splitter, str):
        name = getattr(splitter, "name", type(splitter).__name__)
        return name, splitter
    registry = plugins_or_default(plugins).splitters
    if isinstance(splitter, str):
        entry = registry.entry(splitter)
        origin = splitter_origin(entry.name, plugins)
        if not _accepts(entry.value, model, config, origin):
            raise ConfigError(
                f"splitter {entry.name!r} (from {entry.plugin}) cannot split "
                f"{type(model).__name__}: {_rejection(entry.value, model, origin)}; name another "
                f"splitter or leave it unset to choose automatically")
        return entry.name, entry.value
    entries = sorted(enumerate(registry), key=lambda item: (
        -_priority(item[1].value), item[0]))
    tried = []
    for _, entry in entries:
        origin = splitter_origin(entry.name, plugins)
        try:
            if _accepts(entry.value, model, config, origin):
                return entry.name, entry.value
            tried.append(f"{entry.name}: {_rejection(entry.value, model, origin)}")
        except PluginError as exc:  # a broken splitter is passed over, and said so
            logger.warning("%s; choosing among the other splitters", exc)
            tried.append(f"{entry.name}: broken ({exc})")
    raise ConfigError(
        f"no splitter can split {type(model).__name__} ({'; '.join(tried) or 'none installed'}); "
        f"set module_fqns_per_model_part, give the model a `layers` ModuleList/ModuleDict, make it "
        f"an nn.Sequential, or install a splitter for it (see docs/splitting.md)")


# ----------------------------------------------------------------------------- validation


def _names(model) -> tuple[dict, dict, dict]:
    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return modules, params, buffers


def check_stage_fqns(model, fqns_per_stage, num_stages: int, source: str) -> tuple[list, list]:
    """Check a split and return ``(param_counts, tied_parameters)``; raise ConfigError if bad.

    Every name must be a module, parameter or buffer of ``model``; every parameter must be held
    by a stage. A parameter held by several stages - reachable under several names (a tied
    embedding, one module used twice) or a module named in several parts (NeMo lists
    ``model.rotary_emb`` in every part) - is *tied*: each stage gets a copy and ``Pipeline.step``
    sums their gradients (:mod:`pp_core.parallel.tied`).
    """
    if not isinstance(fqns_per_stage, (list, tuple)) or len(fqns_per_stage) != num_stages:
        got = len(fqns_per_stage) if isinstance(fqns_per_stage, (list, tuple)) else fqns_per_stage
        raise ConfigError(f"{source} gave {got!r} stages, expected {num_stages}")
    modules, params, buffers = _names(model)
    known = set(modules) | set(params) | set(buffers)
    holder: dict[str, list[int]] = {}
    for stage, fqns in enumerate(fqns_per_stage):
        if not fqns:
            raise ConfigError(f"{source}: stage {stage} holds no module; every stage needs at "
                              f"least one (use fewer stages)")
        for fqn in fqns:
            if fqn not in known:
                hint = did_you_mean(fqn, sorted(known), n=3, before="; ")
                raise ConfigError(f"{source}: stage {stage} names {fqn!r}, which is not a module, "
                                  f"parameter or buffer of {type(model).__name__}{hint}")
            holder.setdefault(fqn, []).append(stage)

    def stages_of(name: str) -> set[int]:
        found, parts = set(), name.split(".")
        for end in range(1, len(parts) + 1):
            found.update(holder.get(".".join(parts[:end]), ()))
        return found

    by_tensor: dict[int, list[str]] = {}
    for name, param in params.items():
        by_tensor.setdefault(id(param), []).append(name)
    uncovered, tied = [], []
    counts = [0] * num_stages
    for names in by_tensor.values():
        per_name = {name: stages_of(name) for name in names}
        held = set().union(*per_name.values())
        if not held:
            uncovered.append(names[0])
        if len(held) > 1:  # one tensor on several stages: a copy each, gradients summed
            tied.append(tuple(n for n in names if per_name[n]))
        for stage in held:
            counts[stage] += params[names[0]].numel()
    if uncovered:
        more = f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else ""
        raise ConfigError(
            f"{source}: parameters {uncovered[:8]}{more} are on no stage; add their modules "
            f"(e.g. {_owner(uncovered[0])!r}) to a stage")
    _check_order(fqns_per_stage, source)
    return counts, tied


def _check_order(fqns_per_stage, source: str) -> None:
    """Stages follow the model: within one numbered container (``layers``), a later stage never
    holds a lower index than an earlier one (``[["layers.1"], ["layers.0"]]`` runs backwards)."""
    seen: dict[str, tuple[int, int, str]] = {}  # container -> (highest index, its stage, fqn)
    for stage, fqns in enumerate(fqns_per_stage):
        for fqn in fqns:
            parts = fqn.split(".")
            for depth, piece in enumerate(parts):
                if not piece.isdecimal() or not piece.isascii():
                    continue
                container, index = ".".join(parts[:depth]), int(piece)
                top = seen.get(container)
                if top is not None and top[1] < stage and index < top[0]:
                    raise ConfigError(
                        f"{source}: stage {stage} holds {fqn!r} but the earlier stage {top[1]} "
                        f"holds {top[2]!r}: stages must follow the model's order (stage 0 "
                        f"first); list the parts in model order")
                if top is None or index > top[0]:
                    seen[container] = (index, stage, fqn)
                break


def _owner(name: str) -> str:
    return name.rpartition(".")[0] or name


# ----------------------------------------------------------------------------- planning


def plan_split(
    model,
    config,
    num_ranks: int,
    stages_per_rank: Optional[int] = 1,
    plugins=None,
    splitter=None,
    *,
    variable_stages_per_rank: bool = False,
) -> SplitPlan:
    """Choose a splitter, fix the stage count and return the checked :class:`SplitPlan`.

    :param stages_per_rank: the schedule's stages per rank (``ScheduleDef.stages_per_rank``, or
        ``num_stages / num_ranks`` of a CSV schedule); ``None`` accepts any count.
    :param variable_stages_per_rank: the schedule accepts any count >= 2 (looped schedules).
    :param splitter: a registered name, a splitter object, or ``None`` (automatic).
    Stage count: ``len(config.module_fqns_per_model_part)`` when set, else from
    ``layers_per_stage`` (:func:`virtual_stages`), else ``num_ranks * stages_per_rank``; the
    runtime then builds its schedule with ``plan.stages_per_rank``.
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks!r} must be a positive int")
    name, chosen = select_splitter(model, config, plugins, splitter)
    origin = splitter_origin(name, plugins) if not (splitter is not None and not isinstance(
        splitter, str)) else f"splitter {name!r}"
    _check_methods(chosen, origin)
    schedule = f"schedule {config.pp_schedule!r}" if not config.pp_schedule_csv else \
        f"the CSV schedule {config.pp_schedule_csv!r}"
    fixed = config.module_fqns_per_model_part
    counter = getattr(chosen, "num_layers", None)
    if fixed is not None and config.layers_per_stage is not None:  # NeMo's rule: names win
        warnings.warn(f"module_fqns_per_model_part and layers_per_stage="
                      f"{config.layers_per_stage} are both set; the module lists fix the "
                      f"stages, so layers_per_stage is ignored (unset it to silence this)",
                      UserWarning, stacklevel=2)
    if fixed is not None:
        num_stages, per_rank = _stages_from_fqns(len(fixed), num_ranks, stages_per_rank,
                                                 variable_stages_per_rank, schedule)
    elif counter is not None:
        num_stages, per_rank = virtual_stages(
            plugin_call(origin, "num_layers()", counter, model), config.layers_per_stage, num_ranks, stages_per_rank,
            variable_stages_per_rank, config.round_virtual_stages_to_pp_multiple, schedule)
    elif config.layers_per_stage is not None:
        raise ConfigError(f"layers_per_stage={config.layers_per_stage} is set, but splitter "
                          f"{name!r} does not count layers (no num_layers(model)); unset "
                          f"layers_per_stage or use module_fqns_per_model_part")
    else:
        per_rank = stages_per_rank or 1
        num_stages = num_ranks * per_rank
    fqns = plugin_call(origin, "split()", chosen.split, model, num_stages, config)
    fqns = [list(stage) for stage in fqns] if isinstance(fqns, (list, tuple)) else fqns
    counts, tied = check_stage_fqns(model, fqns, num_stages, f"splitter {name!r}")
    return SplitPlan(num_stages, fqns, name, num_ranks, per_rank, counts, tied, chosen)


def _stages_from_fqns(parts, num_ranks, stages_per_rank, variable, schedule) -> tuple[int, int]:
    per_rank, remainder = divmod(parts, num_ranks)
    expected = num_ranks * (stages_per_rank or 1)
    ok = not remainder and (stages_per_rank is None or per_rank == stages_per_rank
                            or (variable and per_rank >= 2))
    if ok:
        return parts, per_rank
    if variable:
        need = (f"a multiple of num_ranks={num_ranks} with at least 2 per rank "
                f"(e.g. {2 * num_ranks})")
    else:
        need = f"exactly {expected} (num_ranks={num_ranks} x {stages_per_rank} stage(s) per rank)"
    raise ConfigError(
        f"module_fqns_per_model_part has {parts} parts, but {schedule} needs {need}; give that "
        f"many parts, or change the number of ranks or the schedule")
