"""ZB-V: zero bubble on a V placement, with 1F1B's peak memory.

Source: Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv:2401.10241 v2, section 6); the
handcrafted order of sail-sg ``zero-bubble-v0.1.0/handcrafted_zb_v.py`` as ported to torch
``ScheduleZBVZeroBubble``, which this reproduces action for action (so torch CSVs round-trip).
Rank ``r`` holds stages ``r`` and ``2p-1-r``; the forward of a microbatch turns around on rank
``p-1`` and its backward starts on rank 0. Span bubble 0 at ``F = I = W`` (makespan bubble
``(p-1)F``), peak ``2p`` chunk activations. Any ``m >= 1``: like torch, the order is built for
``max(2p-1, m)`` microbatches and the actions of the padding microbatches are dropped.

    num_ranks=2, num_stages=4, num_microbatches=3
    rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2
    rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2
"""

from pp_core import Action, F, I, ScheduleDef, W, hookimpl

__all__ = ["v_schedule"]


def v_schedule(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """torch's ``ScheduleZBVZeroBubble`` order (V placement, two stages per rank)."""
    p, m = num_ranks, num_microbatches
    n = max(2 * p - 1, m)
    return [_rank_order(r, p, m, n) for r in range(p)]


def _rank_order(r: int, p: int, m: int, n: int) -> list[Action]:
    """torch's loops for rank ``r`` over ``n >= 2p-1`` microbatches; those ``>= m`` dropped."""
    c0, c1 = r, 2 * p - 1 - r
    f0, i0, w0, f1, i1, w1 = ([Action(stage, kind, k) for k in range(m)] + [None] * (n - m)
                              for stage in (c0, c1) for kind in (F, I, W))
    warm = 2 * (p - r) - 1
    order = f0[:warm]  # chunk-0 forwards, then r (F(c1), F(c0)) pairs
    for k in range(r):
        order += [f1[k], f0[warm + k]]
    for k in range(p - r):  # the turn: (F, I, W) of chunk 1
        order += [f1[r + k], i1[k], w1[k]]
    # Steady state, n - p rounds: torch's "while f1 < f0 or f0 < n" with f0 = 2p-1-r, f1 = p,
    # i0 = 0, i1 = p-r at the start; the last p-r-1 rounds have no chunk-0 forward left.
    for k in range(n - p):
        if warm + r + k < n:
            order.append(f0[warm + r + k])
        order += [i0[k], w0[k], f1[p + k], i1[p - r + k], w1[p - r + k]]
    for k in range(r):  # drain: I of both chunks, then I/W of chunk 0, then the W left
        order += [i0[n - p + k], i1[n - r + k]]
    for k in range(p - r):
        order += [i0[n - p + r + k], w0[n - p + k]]
    order += w1[n - r:] + w0[n - r:]
    return [a for a in order if a is not None] if n > m else order


@hookimpl
def pp_register_schedules(register):
    register("v_schedule", ScheduleDef(
        generate=v_schedule, aliases=("zbv", "zb_v", "ZBVZeroBubble", "ScheduleZBVZeroBubble"),
        placement="v", stages_per_rank=2, variable_stages_per_rank=False,
        description="ZB-V (torch ZBVZeroBubble): V placement, I/W split, 1F1B memory, any m"))
