"""Frozen stages: the backward work a schedule drops when some stages have nothing to train.

A stage is *trainable* when it holds a parameter that requires a gradient. Two things follow
from a per-stage ``trainable`` flag (fixed before the step, the same on every rank):

* the **frozen prefix** - the stages before the first trainable one - needs no backward at all:
  nothing at or before them learns from a gradient, so their ``B``/``I``/``W`` are dropped, and the
  first trainable stage computes no input gradient and sends none back (:func:`backward_from`
  is its index; lowering emits no ``SEND_B``/``RECV_B`` below it);
* a later stage with nothing trainable has no weight gradient: its ``W`` is dropped and its ``I``
  becomes a ``B`` (the input gradient alone), which also ends its buffers' lifetimes there.

Both are pure rewrites of the compute-only schedule (:func:`without_frozen`), applied after
validation and before lowering; dropping actions from a deadlock-free schedule keeps it
deadlock-free, since every remaining dependency is one the original order already met.
:func:`frozen_table` / :func:`frozen_costs` give the simulator the same knowledge: the dropped actions cost 0, the
frozen stage's ``B`` costs its ``I``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pp_core.schedule.ir import B, I, W, Action, Schedule
from pp_core.schedule.simulate import Costs

__all__ = ["backward_from", "without_frozen", "frozen_table", "frozen_costs", "describe_frozen"]


def backward_from(trainable: Sequence[bool]) -> int:
    """The first stage that runs a backward (``len(trainable)`` when none does)."""
    for stage, flag in enumerate(trainable):
        if flag:
            return stage
    return len(trainable)


def _is_plain(trainable: Optional[Sequence[bool]]) -> bool:
    return trainable is None or all(trainable)


def without_frozen(schedule: Schedule, trainable: Optional[Sequence[bool]]) -> Schedule:
    """``schedule`` without the backward work frozen stages need not do (module docstring).

    :param trainable: per stage, whether it holds a parameter that requires a gradient;
        ``None`` or all true returns ``schedule`` itself.
    """
    if _is_plain(trainable):
        return schedule
    if len(trainable) != schedule.num_stages:
        raise ValueError(f"trainable has {len(trainable)} flags for a schedule of "
                         f"{schedule.num_stages} stages")
    start = backward_from(trainable)
    rows = []
    for row in schedule.actions:
        kept = []
        for action in row:
            if action is not None and action.kind is not None and action.kind in (B, I, W):
                stage = action.stage
                if stage < start:
                    continue
                if not trainable[stage]:
                    if action.kind is W:
                        continue
                    if action.kind is I:
                        action = Action(stage, B, action.microbatch)
            kept.append(action)
        rows.append(kept)
    return dataclasses.replace(schedule, actions=rows)


def frozen_table(table: Sequence[Sequence[float]], trainable: Optional[Sequence[bool]]
                 ) -> list[tuple[float, float, float, float]]:
    """A simulator cost table (``[stage][F, B, I, W]``) for frozen stages: the frozen prefix's
    backward costs nothing; a later stage with nothing trainable has ``W = 0`` and ``B = I``;
    the first trainable stage after a frozen prefix computes no input gradient (``I = 0``, its
    ``W`` does the whole backward, ``B = W``)."""
    rows = [tuple(float(x) for x in row) for row in table]
    if _is_plain(trainable):
        return rows
    start = backward_from(trainable)
    out = []
    for stage, (f, b, i, w) in enumerate(rows):
        if stage < start:
            out.append((f, 0.0, 0.0, 0.0))
        elif not trainable[stage]:
            out.append((f, i, i, 0.0))
        elif stage == start and stage > 0:
            out.append((f, w, 0.0, w))
        else:
            out.append((f, b, i, w))
    return out


def frozen_costs(costs: Costs, num_stages: int, trainable: Optional[Sequence[bool]]) -> Costs:
    """``costs`` for a schedule of ``num_stages`` stages with :func:`frozen_table`'s rule applied
    (``costs`` itself when every stage trains)."""
    if _is_plain(trainable):
        return costs
    rows = frozen_table(costs.table(num_stages), trainable)
    return Costs(F=costs.F, B=costs.B, I=costs.I, W=costs.W,
                 per_stage={s: dict(zip("FBIW", row)) for s, row in enumerate(rows)})


def describe_frozen(trainable: Optional[Sequence[bool]]) -> str:
    """One line for summaries: which stages run no backward and which have no ``W``."""
    if _is_plain(trainable):
        return "every stage trains"
    start = backward_from(trainable)
    parts = []
    if start:
        parts.append(f"stages 0..{start - 1} frozen: no backward" if start > 1
                     else "stage 0 frozen: no backward")
    weightless = [s for s in range(start, len(trainable)) if not trainable[s]]
    if weightless:
        parts.append(f"stages {weightless} without trainable parameters: no W")
    return "; ".join(parts)
