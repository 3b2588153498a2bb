"""Choose a pipeline plan: enumerate, predict step time and memory, drop what does not fit, rank.

The enumeration is every installed schedule (the plugin manager's registry, so a third-party
schedule competes like a built-in) x the stages per rank it allows x every microbatch size that
divides ``pp_batch_size`` and has a profile x the sequence slices per microbatch to try
(``pp_seq_chunks``; one slice's profile, :meth:`~pp_core.planning.costs.ModelProfile.sliced`)
x the cost-balanced split for that stage count
(:func:`pp_core.planning.balance.split_by_profile`). For each point:

* **step time** is the makespan of :func:`pp_core.schedule.simulate` with per-stage costs summed
  from the units of each stage and ``comm_latency`` = the measured point-to-point latency plus
  the largest boundary activation over the measured bandwidth (every cross-rank hand-off is
  charged the slowest one: simple, and pessimistic for uneven boundaries);
* **peak memory per rank** is :func:`pp_core.planning.memory.predict_memory`.

A point that cannot be built (the schedule refuses the microbatch count, more stages than units)
or whose peak exceeds the cap is kept in ``Ranking.dropped`` with the reason, so the table can say
what the faster-looking plans would have needed (the plan objects:
:mod:`pp_core.planning.candidate`). Pure: no torch, no process group.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping, Sequence

from pp_core.config import DEGREE_KEYS
from pp_core.errors import ConfigError, PPCoreError
from pp_core.planning.balance import split_by_profile, stage_fqns
from pp_core.planning.candidate import Candidate, Option, Ranking, label as _label
from pp_core.planning.costs import ModelProfile
from pp_core.planning.memory import predict_memory
from pp_core.planning.recompute import Recompute, plan_stages, with_modes
from pp_core.planning.refine import optimizer_step_s, refine_counts, simulate_split, units_of_counts
from pp_core.planning.sizes import format_bytes
from pp_core.plugin_manager import default_plugins
from pp_core.schedule.build import schedule_from_def
from pp_core.schedule.ir import ScheduleDef

__all__ = ["Option", "Candidate", "Ranking", "candidates", "choose_plan", "predict",
           "schedule_defs", "seq_chunk_choices", "SEQ_CHUNKS"]

MAX_STAGES_PER_RANK = 4
"""Largest stage count per rank tried for schedules that take any (looped schedules): beyond it
every extra hand-off costs more than the smaller bubble wins back on the models pp-core targets."""

REFINE_TOP = 4
"""Plans whose cuts the simulator refines: the ones that could end up first."""


SEQ_CHUNKS = (1, 2, 4, 8)
"""The sequence slices per microbatch ``pp_seq_chunks: auto`` tries (those dividing the rows)."""


def seq_chunk_choices(setting, seq_len: int | None, sliceable: bool) -> tuple[int, ...]:
    """The ``pp_seq_chunks`` values to plan: the one written, or for ``"auto"`` each of
    :data:`SEQ_CHUNKS` that divides ``seq_len`` when the model and loss can take slices
    (``sliceable``: the model says ``pp_seq_slices``, the loss is token-normalised), else 1."""
    if setting != "auto":
        return (setting,)
    if not sliceable or not seq_len:
        return (1,)
    return tuple(k for k in SEQ_CHUNKS if k <= seq_len and seq_len % k == 0)


def schedule_defs(schedules=None) -> dict[str, Any]:
    """``{canonical name: ScheduleDef}`` from a plugin registry, a mapping, or the installed."""
    if schedules is None:
        schedules = default_plugins().schedules
    if isinstance(schedules, Mapping):
        items = schedules.items()
    else:  # a pp_core.plugins.Registry: its entries
        items = ((entry.name, entry.value) for entry in schedules)
    return {name: value if isinstance(value, ScheduleDef) else ScheduleDef(generate=value)
            for name, value in items}


def candidates(profiles: Mapping[int, ModelProfile], pp_size: int, pp_batch_size: int,
               schedules=None, max_stages_per_rank: int = MAX_STAGES_PER_RANK,
               seq_chunks: Sequence[int] = (1,)) -> Iterator[Option]:
    """Every (schedule, stages per rank, microbatch size, sequence slices) worth predicting, in
    a fixed order."""
    defs = schedule_defs(schedules)
    sizes = sorted(size for size in profiles if pp_batch_size % size == 0)
    if not sizes:
        raise ConfigError(f"no profiled microbatch size divides pp_batch_size={pp_batch_size} "
                          f"(profiled: {sorted(profiles)}); profile a divisor of it")
    for name in sorted(defs):
        sdef = defs[name]
        counts = range(2, max(2, max_stages_per_rank) + 1) if sdef.variable_stages_per_rank \
            else (sdef.stages_per_rank,)
        for v in counts:
            for size in sizes:
                for k in seq_chunks:
                    yield Option(name, v, size, pp_batch_size // size, k)


def choose_plan(profiles_by_microbatch_size: Mapping[int, ModelProfile], pp_size: int,
                pp_batch_size: int, schedules=None, memory_cap: int | None = None, *,
                recv_buffer_pool: bool | None = None, pool_slack: int = 2,
                max_stages_per_rank: int = MAX_STAGES_PER_RANK,
                refine_top: int = REFINE_TOP, activation_checkpointing="none",
                every: int = 1, degrees: Mapping[str, int] | None = None,
                seq_chunks: Sequence[int] = (1,)) -> Ranking:
    """Predict every candidate and rank those that fit ``memory_cap`` (bytes per rank).

    :param schedules: a plugin registry (``plugins.schedules``), a ``{name: ScheduleDef}``
        mapping, or ``None`` for the installed schedules.
    :param recv_buffer_pool: ``True``/``False`` fixes the receive-buffer pool; ``None`` lets the
        planner turn it on only for a plan that fits with it and not without.
    :param refine_top: how many of the fastest plans get their cuts moved by the simulator
        (:mod:`pp_core.planning.refine`); 0 keeps the cost-balanced split everywhere.
    :param activation_checkpointing: ``"auto"`` (chosen per stage with the split under the
        cap, :mod:`pp_core.planning.recompute`), one mode for every stage, or a list of one
        mode per stage; ``every`` as ``train.activation_checkpointing.every``.
    :param degrees: the layout's degrees by their YAML names (``pp_size``, ``dp_replicate``,
        ``dp_shard``, ``tp_size``, ``ep_size``; a missing one is 1), carried by every plan.
    :param seq_chunks: the sequence slices per microbatch to try (``pipeline.pp_seq_chunks``;
        :func:`seq_chunk_choices` for ``auto``): each is one more dimension of the enumeration,
        predicted on the profile of one slice (:meth:`ModelProfile.sliced`).
    """
    started = time.perf_counter()
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ConfigError(f"pp_size={pp_size!r} must be a positive int")
    defs = schedule_defs(schedules)
    splits: dict[tuple[int, int], tuple] = {}
    kept, dropped = [], []
    setting = activation_checkpointing
    ac = Recompute(tuple(setting) if isinstance(setting, (list, tuple)) else setting, every,
                   memory_cap, recv_buffer_pool)
    layout = {**dict.fromkeys(DEGREE_KEYS.values(), 1), "pp_size": pp_size, **(degrees or {})}
    for option in candidates(profiles_by_microbatch_size, pp_size, pp_batch_size, defs,
                             max_stages_per_rank, seq_chunks):
        profile = profiles_by_microbatch_size[option.microbatch_size]
        candidate = _predict(option, defs[option.schedule], profile, pp_size, splits,
                             pool_slack, ac)
        if candidate.dropped is None:
            _fit(candidate, memory_cap, recv_buffer_pool)
        (kept if candidate.dropped is None else dropped).append(candidate)
    kept.sort(key=lambda c: (c.predicted_step_s, c.peak_bytes, _label(c)))
    if refine_top:
        dropped += _refine(kept, defs, profiles_by_microbatch_size, pp_size, memory_cap,
                           recv_buffer_pool, pool_slack, refine_top, ac)
        kept.sort(key=lambda c: (c.predicted_step_s, c.peak_bytes, _label(c)))
    dropped.sort(key=lambda c: (c.predicted_step_s is None, c.predicted_step_s or 0, _label(c)))
    for candidate in kept + dropped:
        candidate.degrees = dict(layout)
    return Ranking(kept, dropped, memory_cap, time.perf_counter() - started, pp_size,
                   pp_batch_size)


def predict(option: Option, sdef, profile: ModelProfile, pp_size: int,
            fqns_per_stage: list[list[str]] | None = None, slack: int = 2,
            ac: Recompute | None = None) -> Candidate:
    """One candidate's prediction; ``fqns_per_stage`` replaces the cost-balanced split (to
    predict a split made another way, e.g. the ``layers`` splitter's). The stages must be made
    of whole units."""
    splits = {}
    if fqns_per_stage is not None:
        splits[(option.microbatch_size, len(fqns_per_stage), option.seq_chunks)] = \
            (fqns_per_stage, _units_of(profile, fqns_per_stage))
    return _predict(option, sdef, profile, pp_size, splits, slack, ac)


def _predict(option: Option, sdef, profile: ModelProfile, pp_size: int, splits: dict,
             slack: int, ac: Recompute | None = None) -> Candidate:
    candidate = Candidate(option)
    profile = profile.sliced(option.seq_chunks)  # with slices a unit of the schedule is a slice
    num_stages = pp_size * option.stages_per_rank
    if num_stages > len(profile.units):
        candidate.dropped = (f"needs {num_stages} stages, the model has {len(profile.units)} "
                             f"units to place")
        return candidate
    try:
        schedule = _schedule(option, sdef, pp_size)
    except PPCoreError as exc:
        candidate.dropped = f"the schedule refuses these sizes: {exc}"
        return candidate
    key = (option.microbatch_size, num_stages, option.seq_chunks)
    if key not in splits:
        splits[key] = _split(profile, num_stages)
    fqns, units = splits[key]
    if ac is not None and ac.setting != "none":
        units, modes = plan_stages(schedule, profile, units, ac, slack)
        if isinstance(modes, str):
            candidate.dropped = modes
            return candidate
        fqns = stage_fqns([unit.fqns for unit in profile.units], [len(u) for u in units],
                          _shared(profile, fqns))
        candidate.activation_checkpointing = modes
        profile = with_modes(profile, units, modes, ac.every)
    candidate.fqns_per_stage = fqns
    result = simulate_split(schedule, profile, units, with_memory=True)
    candidate.optimizer_step_s = optimizer_step_s(schedule, profile, units)
    candidate.predicted_step_s = result.makespan + candidate.optimizer_step_s
    candidate.bubble_ratio = result.bubble_ratio
    candidate.memory = predict_memory(profile, schedule, units, result.peak_activation_bytes,
                                      slack)
    return candidate


def _schedule(option: Option, sdef, pp_size: int):
    return schedule_from_def(option.schedule, sdef, num_ranks=pp_size,
                             num_microbatches=option.num_microbatches,
                             stages_per_rank=option.stages_per_rank,
                             seq_chunks=option.seq_chunks)


def _refine(kept: list, defs, profiles, pp_size: int, cap, pool, slack: int,
            top: int, ac: Recompute | None = None) -> list[Candidate]:
    """Let the simulator move the cuts of the ``top`` fastest plans
    (:mod:`pp_core.planning.refine`); a refined split replaces the balanced one when it is
    predicted faster and still fits. Returns the faster refined splits the cap refused."""
    refused = []
    for index, candidate in enumerate(kept[:top]):
        option = candidate.option
        profile = profiles[option.microbatch_size].sliced(option.seq_chunks)
        counts = [len(u) for u in _units_of(profile, candidate.fqns_per_stage)]
        schedule = _schedule(option, defs[option.schedule], pp_size)
        modes = candidate.activation_checkpointing
        makespan = None
        if modes is not None and any(m != "none" for m in modes):
            def makespan(trial, modes=modes, profile=profile, schedule=schedule):
                units = units_of_counts(trial)
                return simulate_split(schedule, with_modes(profile, units, modes, ac.every),
                                      units).makespan
        better, seconds = refine_counts(schedule, profile, counts, makespan)
        if better == counts or seconds >= candidate.predicted_step_s - candidate.optimizer_step_s:
            continue
        fqns = stage_fqns([unit.fqns for unit in profile.units], better,
                          _shared(profile, candidate.fqns_per_stage))
        refined = predict(option, defs[option.schedule], profiles[option.microbatch_size],
                          pp_size, fqns, slack, ac)
        _fit(refined, cap, pool)
        if refined.dropped is None:
            kept[index] = refined
        else:
            refined.dropped = f"its simulator-refined split: {refined.dropped}"
            refused.append(refined)
    return refused


def _split(profile: ModelProfile, num_stages: int) -> tuple[list[list[str]], list[list[int]]]:
    """The cost-balanced split: FQNs per stage, and the unit indices behind them."""
    fqns = [list(stage) for stage in split_by_profile(profile, num_stages)]
    return fqns, _units_of(profile, fqns)


def _shared(profile: ModelProfile, fqns_per_stage) -> list[str]:
    """The FQNs a split lists on every stage that belong to no unit (a rotary table)."""
    unit_fqns = {fqn for unit in profile.units for fqn in unit.fqns}
    return [f for f in fqns_per_stage[0] if f not in unit_fqns] if fqns_per_stage else []


def _units_of(profile: ModelProfile, fqns_per_stage) -> list[list[int]]:
    """Per stage, the indices of the units its FQNs make up (modules shared by every stage,
    such as a rotary table, belong to no unit)."""
    unit_of = {fqn: index for index, unit in enumerate(profile.units) for fqn in unit.fqns}
    return [sorted({unit_of[f] for f in stage if f in unit_of}) for stage in fqns_per_stage]


def _fit(candidate: Candidate, cap: int | None, pool: bool | None) -> None:
    """Decide the pool setting and drop the candidate when even that exceeds ``cap``."""
    without = max(m.total(False) for m in candidate.memory)
    with_pool = max(m.total(True) for m in candidate.memory)
    if pool is not None:
        candidate.pool = pool
    else:  # the pool only when it is what makes the plan fit
        candidate.pool = cap is not None and without > cap >= with_pool
    if cap is not None and candidate.peak_bytes > cap:
        worst = max(candidate.memory, key=lambda m: m.total(candidate.pool))
        pool_note = "" if candidate.pool or pool is False else \
            f" (with the receive-buffer pool {format_bytes(with_pool)})"
        candidate.dropped = (f"predicted peak {format_bytes(candidate.peak_bytes)} on rank "
                             f"{worst.rank}{pool_note} > memory cap {format_bytes(cap)}")
