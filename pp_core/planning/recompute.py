"""Activation checkpointing (AC) chosen per stage, jointly with the split (pure).

A stage that holds many microbatches in flight (the first ones in 1F1B: stage ``s`` of ``P``
holds ``P - s``) pays for its saved activations many times over; a late one holds few. So under a
memory cap the cheapest plan that fits recomputes where the bytes are and nowhere else. For one
candidate (schedule, stages per rank, microbatch size, split) :func:`choose_modes`:

1. starts every stage at its cheapest allowed mode (``none`` under ``auto``);
2. while a rank's predicted peak is over the cap, takes on that rank the step up the ladder
   ``none -> selective -> full`` of one of its stages that makes it fit for the least added
   recompute time, or else the one that saves the most bytes per added second;
3. steps back down every stage it can while every rank still fits (a late big step may have made
   an early one unneeded).

Memory is separable per rank (a rank's bytes follow its own order of actions), so each trial is
one byte replay (:func:`pp_core.schedule.peak_bytes.peak_activation_bytes`), not a timing
simulation. :func:`plan_stages` then lets the split follow: with the modes fixed, the units are
re-cut so each stage's time *under its own mode* is balanced (a recomputing stage gets fewer
units, the others more), the modes are chosen again for that cut, and the faster of the two
plans that fit is kept. The units' costs under each mode are the profile's
(:attr:`pp_core.planning.costs.UnitCost.recompute`, measured by
:mod:`pp_core.measure.recompute`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

from pp_core.planning.costs import ModelProfile, UnitCost
from pp_core.planning.memory import (
    add_floors,
    boundary_bytes,
    kept_input_bytes,
    posts_receives_early,
    predict_memory,
    recv_bytes_per_action,
    sent_bytes_per_action,
    stage_held_bytes,
    stage_transients,
)
from pp_core.planning.refine import simulate_split, units_of_counts
from pp_core.schedule.peak_bytes import peak_activation_bytes
from pp_core.schedule.lower import lower
from pp_core.schedule.validate import encode_validated

__all__ = ["LADDER", "Recompute", "with_modes", "choose_modes", "plan_stages", "balance_by_mode"]

LADDER = ("none", "selective", "full")
"""The built-in modes, from the fewest saved bytes recomputed to the most."""


@dataclass(frozen=True)
class Recompute:
    """What the planner may do about AC: ``setting`` is ``"auto"`` (choose per stage), one mode
    for every stage, or a list with one mode per stage (``train.activation_checkpointing``);
    ``every`` as that key's (a mode acts on blocks whose index is a multiple of it)."""

    setting: str | tuple[str, ...] = "none"
    every: int = 1
    cap: int | None = None
    pool: bool | None = None

    def allowed(self, profile: ModelProfile, units: Sequence[Sequence[int]]):
        """Per stage, the modes it may run (in ladder order), or a reason none fits."""
        if isinstance(self.setting, tuple):
            if len(self.setting) != len(units):
                return (f"train.activation_checkpointing.mode names {len(self.setting)} stages, "
                        f"this plan has {len(units)}")
            return [(mode,) for mode in self.setting]
        if self.setting != "auto":
            return [(self.setting,)] * len(units)
        out = []
        for stage in units:
            measured = [set(profile.units[u].modes()) for u in stage
                        if profile.units[u].recompute]
            common = set.intersection(*measured) if measured else {"none"}
            out.append(tuple(m for m in LADDER if m in common))
        return out


def _applies(fqns: Sequence[str], every: int) -> bool:
    key = fqns[0].rsplit(".", 1)[-1] if fqns else ""
    return every == 1 or not key.isdigit() or int(key) % every == 0


@functools.lru_cache(maxsize=4096)
def _under(unit: UnitCost, mode: str, every: int) -> UnitCost:
    """``unit`` costed under ``mode`` (itself when that mode is not measured, or ``every``
    skips its block); cached: the search asks for the same few many times."""
    if mode == "none" or mode not in unit.modes() or not _applies(unit.fqns, every):
        return unit
    return unit.under(mode)


def with_modes(profile: ModelProfile, units: Sequence[Sequence[int]], modes: Sequence[str],
               every: int = 1) -> ModelProfile:
    """``profile`` with each unit costed under its stage's mode (a unit without that mode
    measured, or skipped by ``every``, as it is)."""
    out = list(profile.units)
    for stage, mode in zip(units, modes):
        for u in stage:
            out[u] = _under(out[u], mode, every)
    return dataclasses.replace(profile, units=tuple(out))


def _seconds(unit: UnitCost) -> float:
    return unit.forward_s + unit.backward_s


class _Ranks:
    """Predicted totals per rank for any modes on one schedule and split. A stage's terms
    (bytes per microbatch, split-backward holdings, transient) depend on its own units only, so
    they are worked out once per mode; a trial is then one byte replay."""

    def __init__(self, schedule, profile, units, settings: Recompute, slack: int, program=None):
        self.schedule, self.profile, self.units, self.settings = schedule, profile, units, settings
        self.encoded = encode_validated(schedule, check_deadlock=False)
        self.program = lower(schedule) if program is None else program
        self.base = predict_memory(profile, schedule, units, [0.0] * schedule.num_ranks, slack,
                                   self.program)
        # beside the activations action by action: sent gradients, and without the pool the
        # receive buffers (the split fixes them; the modes do not change a stage's boundary)
        self.boundary = boundary_bytes(profile, units)
        self.sent = sent_bytes_per_action(schedule, self.boundary, self.program)
        self.posts_early = posts_receives_early(profile)
        self.floors: dict[tuple, list] = {}  # by what each stage keeps of its input
        self.stages = [list(schedule.stages_of(rank)) for rank in range(schedule.num_ranks)]
        self.terms: dict[str, tuple[list[int], list[int], list[int]]] = {}
        self.extra: dict[tuple[int, str], float] = {}

    def _terms(self, mode: str):
        if mode not in self.terms:
            eff = with_modes(self.profile, self.units, [mode] * len(self.units),
                             self.settings.every)
            saved, held = stage_held_bytes(eff, self.units)
            self.terms[mode] = (saved, held, stage_transients(eff, self.units))
        return self.terms[mode]

    def totals(self, modes) -> list[int]:
        """Per rank, :meth:`RankMemory.total` with these modes (the pool as the settings say,
        or the better of the two when the planner chooses it)."""
        terms = [self._terms(mode) for mode in modes]
        pool = self.settings.pool
        replay = [[t[i][s] for s, t in enumerate(terms)] for i in range(3)]

        def running(pooled: bool) -> list[float]:  # its backwards' temporaries included
            if pooled:  # the pool's buffers are there the whole step
                return [a + base.recv_pool for a, base in zip(
                    peak_activation_bytes(self.schedule, replay[0], replay[1], self.encoded,
                                          replay[2], self.sent), self.base)]
            return peak_activation_bytes(self.schedule, replay[0], replay[1], self.encoded,
                                         replay[2], self._floor(modes))

        choices = (pool,) if pool is not None else (False, True)
        peaks = {pooled: running(pooled) for pooled in choices}
        out = []
        for rank, base in enumerate(self.base):
            fixed = base.params + base.grads + base.optimizer
            totals = [fixed + max(peaks[pooled][rank],
                                  (base.recv_pool if pooled else 0) + base.optimizer_step)
                      for pooled in choices]
            out.append(int(min(totals)))
        return out

    def _floor(self, modes) -> list:
        """Sent gradients and receive buffers per action without the pool; a received input
        counted until its forward where the stage's first unit keeps it (its mode decides)."""
        firsts = tuple(_under(self.profile.units[units[0]], mode, self.settings.every)
                       .saved_input_bytes for units, mode in zip(self.units, modes))
        kept = tuple(kept_input_bytes(self.profile, self.units, firsts))
        if kept not in self.floors:
            self.floors[kept] = add_floors(self.sent, recv_bytes_per_action(
                self.schedule, self.boundary, self.program, self.posts_early, kept))
        return self.floors[kept]

    def extra_s(self, stage: int, mode: str) -> float:
        """Seconds a stage adds per step in ``mode``: the recompute, and what the mode's
        forward costs over the plain one (``selective``'s contexts, measured dearer than the
        matmuls they save on a narrow CPU model)."""
        key = (stage, mode)
        if key not in self.extra:
            units = [self.profile.units[u] for u in self.units[stage]]
            self.extra[key] = self.schedule.num_microbatches * sum(
                _seconds(_under(u, mode, self.settings.every)) - _seconds(u) for u in units)
        return self.extra[key]


def choose_modes(schedule, profile: ModelProfile, units: Sequence[Sequence[int]],
                 settings: Recompute, slack: int = 2, program=None) -> list[str] | str:
    """The modes per stage (module docstring), or a reason when the setting cannot hold."""
    allowed = settings.allowed(profile, units)
    if isinstance(allowed, str):
        return allowed
    modes = [options[0] for options in allowed]
    cap = settings.cap
    if cap is None or all(len(options) == 1 for options in allowed):
        return modes
    ranks = _Ranks(schedule, profile, units, settings, slack, program)
    totals = ranks.totals(modes)
    while max(totals) > cap:
        rank = max(range(len(totals)), key=lambda r: totals[r] - cap)
        steps = [(s, m) for s in schedule.stages_of(rank) for m in allowed[s]
                 if LADDER.index(m) > LADDER.index(modes[s])]
        if not steps:
            break
        trials = []
        for stage, mode in steps:
            trial = list(modes)
            trial[stage] = mode
            after = ranks.totals(trial)
            added = ranks.extra_s(stage, mode) - ranks.extra_s(stage, modes[stage])
            trials.append((after[rank] <= cap, max(added, 1e-12), totals[rank] - after[rank],
                           trial, after))
        fitting = [t for t in trials if t[0]]
        best = min(fitting, key=lambda t: t[1]) if fitting else \
            max(trials, key=lambda t: t[2] / t[1])
        if not best[0] and best[2] <= 0:
            break
        modes, totals = best[3], best[4]
    if max(totals) <= cap:  # step back down where the cap allows, dearest recompute first
        for stage in sorted(range(len(modes)), key=lambda s: -ranks.extra_s(s, modes[s])):
            for mode in allowed[stage]:
                if LADDER.index(mode) >= LADDER.index(modes[stage]):
                    break
                trial = list(modes)
                trial[stage] = mode
                if max(ranks.totals(trial)) <= cap:
                    modes = trial
                    break
    return modes


def balance_by_mode(profile: ModelProfile, num_stages: int, modes: Sequence[str],
                    every: int = 1) -> list[int]:
    """Unit counts per stage minimising the slowest stage's F + B, each stage's units costed
    under its own mode (contiguous, none empty; exact, by dynamic programming)."""
    n = len(profile.units)
    cost = [[(u.under(m) if m in u.modes() and _applies(u.fqns, every) else u)
             for u in profile.units] for m in modes]
    prefix = [[0.0] for _ in modes]
    for s, units in enumerate(cost):
        for u in units:
            prefix[s].append(prefix[s][-1] + u.forward_s + u.backward_s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for end in range(s, n - (num_stages - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1][start], prefix[s - 1][end] - prefix[s - 1][start])
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, start
    counts, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


def _uniform(allowed, dearest: str) -> list[str]:
    """Per stage, ``dearest`` or the dearest mode below it the stage allows (a stage without
    blocks allows only ``none``)."""
    return [max((m for m in options if LADDER.index(m) <= LADDER.index(dearest)),
                key=LADDER.index) for options in allowed]


def plan_stages(schedule, profile: ModelProfile, units: Sequence[Sequence[int]],
                settings: Recompute, slack: int = 2):
    """``(units per stage, modes per stage)``: the modes for this cut; the cut re-balanced under
    those modes, and the cut balanced for the dearest of them on every stage, each with its own
    modes and with that dearest mode everywhere (what a uniform setting runs: without it ``auto``
    could lose to every stage ``full``); whichever fits and is predicted faster."""
    program = lower(schedule)
    modes = choose_modes(schedule, profile, units, settings, slack, program)
    if isinstance(modes, str) or all(m == "none" for m in modes) or settings.setting != "auto":
        return [list(u) for u in units], modes
    options = [([list(u) for u in units], modes)]
    dearest = LADDER[max(LADDER.index(m) for m in modes)]
    for balanced_for in (modes, [dearest] * len(units)):  # the second: a uniform setting's cut
        moved = units_of_counts(balance_by_mode(profile, len(units), balanced_for,
                                                settings.every))
        if all(moved != cut for cut, _ in options):
            again = choose_modes(schedule, profile, moved, settings, slack, program)
            if not isinstance(again, str):
                options.append((moved, again))
        uniform = _uniform(settings.allowed(profile, moved), dearest)
        if (moved, uniform) not in options:
            options.append((moved, uniform))
    if len(options) == 1:
        return options[0]

    def score(option):
        cut, chosen = option
        eff = with_modes(profile, cut, chosen, settings.every)
        fits = settings.cap is None or max(_Ranks(schedule, profile, cut, settings, slack,
                                                  program).totals(chosen)) <= settings.cap
        return (not fits, simulate_split(schedule, eff, cut).makespan)

    return min(options, key=score)
