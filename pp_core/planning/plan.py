"""The one planning function: model + config + ranks + plugins -> split plan, schedule, program.

``build_pipeline`` (every rank, on the real model), ``pp-core validate`` (the parent process, on
a meta model) and the run summary all plan through :func:`plan_pipeline`, so what validation
accepts is what the ranks build. The order of its steps is the contract:

1. :func:`schedule_shape` - the schedule's stages per rank: the registered schedule's default
   (``ScheduleDef.stages_per_rank``) or, for a CSV, its stage count over the ranks (a CSV must
   give every rank the same number of stages, since the split does);
2. the split (:func:`~pp_core.planning.split.plan_split`), which may fix another stage count
   (``module_fqns_per_model_part``, ``layers_per_stage``) where the schedule accepts one;
3. the schedule for the split's stages per rank (a CSV schedule is taken as read), checked to run
   the split's number of stages;
4. the lowered program (:func:`~pp_core.schedule.lower.lower`), computed on first use, without
   the backward work of frozen stages (:mod:`pp_core.schedule.frozen`; ``trainable``: per stage,
   whether it holds a parameter that requires a gradient, read from the model as split).

Errors of steps 1 and 3 carry ``field="pp_schedule"`` or ``"pp_schedule_csv"`` (the setting to
change); errors of the split keep their own. Torch is imported only by the split (step 2), so
planning without a model (``model=None``: schedule only) stays torch-free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from pp_core.errors import ConfigError, about
from pp_core.planning.split import plan_split
from pp_core.planning.trainable import stage_trainable
from pp_core.plugin_manager import plugins_or_default
from pp_core.schedule.build import build_schedule, resolve_schedule_def
from pp_core.schedule.frozen import backward_from, without_frozen
from pp_core.schedule.lower import lower

__all__ = ["PipelinePlan", "ScheduleShape", "plan_pipeline", "schedule_shape", "schedule_field"]


@dataclass(frozen=True)
class ScheduleShape:
    """What the schedule fixes before the split: stages per rank, and whether it may vary."""

    stages_per_rank: int
    variable: bool = False
    csv_schedule: Any = None
    """The schedule read from ``pp_schedule_csv`` (``None`` for a registered schedule)."""


@dataclass
class PipelinePlan:
    """The split, the schedule and (lazily) its lowered program; the same on every rank.

    ``split`` is ``None`` when planning ran without a model. ``rank`` is the rank that asked
    (``None`` in the parent process); :attr:`stage_indices` are its stages.
    """

    schedule: Any
    split: Any = None
    rank: Optional[int] = None
    trainable: Optional[tuple] = None
    """Per stage, whether it holds a parameter that requires a gradient (``None``: all do)."""

    @functools.cached_property
    def program(self):
        """The lowered program of every rank (:class:`~pp_core.schedule.lower.Program`), less
        the backward work of frozen stages (:mod:`pp_core.schedule.frozen`)."""
        if self.trainable is None:
            return lower(self.schedule)
        return lower(without_frozen(self.schedule, self.trainable),
                     backward_from(self.trainable))

    @property
    def stage_indices(self) -> tuple[int, ...]:
        if self.rank is None:
            raise ConfigError("this plan was made without a rank; pass rank= to plan_pipeline")
        return self.schedule.stages_of(self.rank)


def schedule_field(config) -> str:
    """The setting that decides the schedule: ``pp_schedule_csv`` when set, else ``pp_schedule``."""
    return "pp_schedule_csv" if config.pp_schedule_csv is not None else "pp_schedule"


def schedule_shape(config, num_ranks: int, plugins=None) -> ScheduleShape:
    """Step 1: the schedule's stages per rank, before any model is looked at."""
    plugins = plugins_or_default(plugins)
    with about(schedule_field(config)):
        if config.pp_schedule_csv is None:
            sdef = resolve_schedule_def(config.pp_schedule, plugins)[1]
            return ScheduleShape(sdef.stages_per_rank, sdef.variable_stages_per_rank)
        schedule = build_schedule(num_ranks=num_ranks, num_microbatches=config.num_microbatches,
                                  csv_path=config.pp_schedule_csv, plugins=plugins)
        per_rank, uneven = divmod(schedule.num_stages, num_ranks)
        if uneven:
            counts = [len(schedule.stages_of(r)) for r in range(num_ranks)]
            raise ConfigError(
                f"the CSV schedule {config.pp_schedule_csv!r} places {schedule.num_stages} stages "
                f"on {num_ranks} ranks unevenly ({counts} per rank); pp-core splits the model "
                f"into the same number of stages on every rank, so place "
                f"{num_ranks * (per_rank or 1)} or {num_ranks * (per_rank + 1)} stages")
        return ScheduleShape(per_rank, False, schedule)


def plan_pipeline(model, config, num_ranks: int, *, rank: Optional[int] = None,
                  plugins=None, splitter=None) -> PipelinePlan:
    """Plan ``model`` (real or on the meta device; ``None``: schedule only) for ``num_ranks``.

    :param config: a :class:`~pp_core.PipelineConfig`.
    :param rank: this rank, for :attr:`PipelinePlan.stage_indices`.
    :param plugins: a :class:`~pp_core.plugin_manager.Plugins` (default: the installed plugins).
    :param splitter: a splitter name or object (``BalancedSplitter(profile)``); None: automatic.
    :raises PPCoreError: the first step that fails (see the module docstring); nothing is built.
    """
    plugins = plugins_or_default(plugins)
    if config.pp_seq_chunks == "auto":
        raise ConfigError("pipeline.pp_seq_chunks: auto is chosen by the planner; set pipeline."
                          "pp_schedule: auto (or write the plan with 'pp-core plan FILE -o "
                          "chosen.yaml'), or give pp_seq_chunks a number", field="pp_seq_chunks")
    shape = schedule_shape(config, num_ranks, plugins)
    split, per_rank = None, shape.stages_per_rank
    if model is not None:
        split = plan_split(model, config, num_ranks, shape.stages_per_rank, plugins, splitter,
                           variable_stages_per_rank=shape.variable)
        per_rank = split.stages_per_rank
    schedule = shape.csv_schedule
    if schedule is None:
        with about(schedule_field(config)):
            schedule = build_schedule(config.pp_schedule, num_ranks=num_ranks,
                                      num_microbatches=config.num_microbatches,
                                      stages_per_rank=per_rank, plugins=plugins,
                                      seq_chunks=config.pp_seq_chunks)
    if split is not None and split.num_stages != schedule.num_stages:
        raise ConfigError(f"the split has {split.num_stages} stages but schedule "
                          f"{schedule.name!r} runs {schedule.num_stages}; make them agree",
                          field=schedule_field(config))
    trainable = None if split is None else stage_trainable(model, split.fqns_per_stage)
    return PipelinePlan(schedule, split, rank, trainable)
