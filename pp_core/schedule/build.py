"""Build a validated :class:`Schedule` from a registered schedule name or a CSV file.

This is the one entry point the runtime, the CLI and the benchmarks use, so every size check
lives here with a message that says what to change: the plugin says *how* to order actions
(its :class:`ScheduleDef`), this module decides *for which sizes* and checks the result.
"""

from __future__ import annotations

import contextlib
import gc
import os

from pp_core.errors import ConfigError, ScheduleError
from pp_core.plugin_manager import plugins_or_default
from pp_core.schedule.csv_io import read_csv
from pp_core.schedule.ir import Schedule, ScheduleDef, stage_to_rank
from pp_core.schedule.limits import size_problem
from pp_core.schedule.slices import cut_into_slices
from pp_core.schedule.validate import validate_schedule

__all__ = ["build_schedule", "schedule_from_def", "resolve_schedule_def", "gc_paused"]


def build_schedule(
    name: str | None = None,
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    csv_path: str | os.PathLike | None = None,
    plugins=None,
    seq_chunks: int = 1,
) -> Schedule:
    """The validated schedule ``name`` (or the one in ``csv_path``) for these sizes.

    :param name: a registered schedule name or alias, case-insensitive (``"1f1b"``,
        ``"Interleaved1F1B"``, ...). Ignored when ``csv_path`` is given, as torchtitan ignores
        ``pipeline_parallel_schedule`` when ``pipeline_parallel_schedule_csv`` is set.
    :param num_ranks: pipeline ranks (``pp``).
    :param num_microbatches: microbatches per step.
    :param stages_per_rank: stages each rank holds; defaults to the schedule's own default. Only
        schedules registered with ``variable_stages_per_rank=True`` accept other values.
    :param csv_path: a torch-format CSV (compute-only or compute_comms); the placement is taken
        from the rows, and ``num_ranks`` / ``num_microbatches`` / ``stages_per_rank`` must match.
    :param plugins: a :class:`pp_core.plugin_manager.Plugins`; defaults to the installed plugins.
    :param seq_chunks: sequence slices per microbatch (:mod:`pp_core.schedule.slices`); the
        schedule then has ``num_microbatches * seq_chunks`` units. A CSV takes only 1.
    :raises ScheduleError: unknown name, impossible sizes, or an invalid schedule.
    """
    _check_int("num_ranks", num_ranks, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("seq_chunks", seq_chunks, 1)
    if stages_per_rank is not None:
        _check_int("stages_per_rank", stages_per_rank, 1)
    too_large = size_problem(num_ranks, stages_per_rank, num_microbatches)
    if too_large is not None:
        raise ScheduleError(too_large)
    if csv_path is not None:
        if seq_chunks != 1:
            raise ScheduleError(
                f"seq_chunks={seq_chunks} cannot run a schedule CSV ({os.fspath(csv_path)!r}): "
                f"a CSV orders whole microbatches; set seq_chunks=1 or name a schedule")
        return _from_csv(csv_path, num_ranks, num_microbatches, stages_per_rank)
    if name is None:
        raise ScheduleError("build_schedule needs a schedule name (e.g. '1f1b') or csv_path")
    canonical, sdef = resolve_schedule_def(name, plugins)
    return schedule_from_def(canonical, sdef, num_ranks=num_ranks,
                             num_microbatches=num_microbatches, stages_per_rank=stages_per_rank,
                             seq_chunks=seq_chunks)


def schedule_from_def(canonical: str, sdef: ScheduleDef, *, num_ranks: int,
                      num_microbatches: int, stages_per_rank: int | None = None,
                      seq_chunks: int = 1) -> Schedule:
    """The validated schedule of an already resolved :class:`ScheduleDef` (the planner walks a
    registry's definitions and needs no name lookup per candidate). With ``seq_chunks`` K > 1
    the generator orders ``num_microbatches * K`` units, which
    :func:`~pp_core.schedule.slices.cut_into_slices` makes run as slices."""
    num_microbatches *= seq_chunks
    v = sdef.stages_per_rank if stages_per_rank is None else stages_per_rank
    if v != sdef.stages_per_rank and not sdef.variable_stages_per_rank:
        raise ScheduleError(
            f"schedule {canonical!r} runs exactly {sdef.stages_per_rank} stage(s) per rank, got "
            f"stages_per_rank={v}; set stages_per_rank={sdef.stages_per_rank} (or leave it unset), "
            f"or pick a schedule that takes {v} stages per rank (e.g. 'interleaved_1f1b')")
    num_stages = num_ranks * v
    too_large = size_problem(num_ranks, v, num_microbatches)
    if too_large is not None:
        raise ScheduleError(too_large)
    stage_ranks = stage_to_rank(sdef.placement, num_stages, num_ranks)
    with gc_paused():
        try:
            actions = sdef.generate(num_stages, num_microbatches, num_ranks)
        except ScheduleError:
            raise
        except Exception as exc:
            raise ScheduleError(
                f"schedule {canonical!r}: its generator failed for num_stages={num_stages}, "
                f"num_microbatches={num_microbatches}, num_ranks={num_ranks} with "
                f"{type(exc).__name__}: {exc} (this is a bug in the plugin that registered "
                f"{canonical!r})") from exc
    if not isinstance(actions, (list, tuple)) or len(actions) != num_ranks:
        got = len(actions) if isinstance(actions, (list, tuple)) else type(actions).__name__
        raise ScheduleError(
            f"schedule {canonical!r}: its generator returned {got} rank lists for "
            f"num_ranks={num_ranks}; a generator must return one list of actions per rank "
            f"(this is a bug in the plugin that registered {canonical!r})")
    if seq_chunks > 1:
        with gc_paused():
            actions = cut_into_slices(actions, stage_ranks, num_microbatches, seq_chunks,
                                      canonical)
    schedule = Schedule(
        actions=[list(row) for row in actions],
        stage_ranks=stage_ranks,
        num_microbatches=num_microbatches,
        name=canonical,
        seq_chunks=seq_chunks,
    )
    with gc_paused():
        validate_schedule(schedule)
    return schedule


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while hundreds of thousands of small tuples are made.

    Generating and checking a schedule creates no reference cycles, but every collection the
    allocations trigger rescans the growing action lists (about half the build time at pp=64,
    m=1024). Reference counting still frees everything; the collector resumes afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def resolve_schedule_def(name: str, plugins=None) -> tuple[str, ScheduleDef]:
    """``(canonical name, ScheduleDef)`` for a name or alias; unknown names list the installed.

    A plugin that registered a bare generator function gets it wrapped in a default
    :class:`ScheduleDef` (one stage per rank, loop placement).
    """
    plugins = plugins_or_default(plugins)
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"schedule name must be a non-empty string, got {name!r}")
    if name.lower() == "auto" and "auto" not in plugins.schedules:
        raise ConfigError(
            "pp_schedule='auto' is not a schedule but a request to choose one: plan it with "
            "pp_core.plan_auto(model, config, inputs, target, pp_size) and pass "
            "its .config to build_pipeline (the YAML launcher and 'pp-core plan' do this)")
    registry = plugins.schedules
    if name not in registry:
        try:
            registry.entry(name)
        except Exception as exc:  # the registry's message lists installed names and plugins
            raise ScheduleError(str(exc)) from exc
    entry = registry.entry(name)
    value = entry.value
    return entry.name, value if isinstance(value, ScheduleDef) else ScheduleDef(generate=value)


def _check_int(what: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ScheduleError(f"{what} must be an integer >= {minimum}, got {value!r}")


def _from_csv(csv_path, num_ranks: int, num_microbatches: int,
              stages_per_rank: int | None) -> Schedule:
    schedule = read_csv(csv_path)  # validated
    where = f"schedule CSV {os.fspath(csv_path)!r}"
    if schedule.num_ranks != num_ranks:
        raise ScheduleError(
            f"{where} has {schedule.num_ranks} rows (one per rank), but the pipeline has "
            f"num_ranks={num_ranks}; write one row per pipeline rank or change the pp size")
    if schedule.num_microbatches != num_microbatches:
        raise ScheduleError(
            f"{where} schedules {schedule.num_microbatches} microbatches (0..."
            f"{schedule.num_microbatches - 1}), but num_microbatches={num_microbatches}; "
            f"set pp_batch_size / pp_microbatch_size to give {schedule.num_microbatches} "
            f"microbatches or regenerate the CSV")
    if stages_per_rank is not None and schedule.num_stages != num_ranks * stages_per_rank:
        raise ScheduleError(
            f"{where} has {schedule.num_stages} stages on {num_ranks} ranks, but "
            f"stages_per_rank={stages_per_rank} asks for {num_ranks * stages_per_rank}")
    return schedule
