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

from pp_core import Action, F, I, ScheduleDef, ScheduleError, W, hookimpl

__all__ = ["v_schedule"]


def v_schedule(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """torch's ``ScheduleZBVZeroBubble`` order (V placement, two stages per rank)."""
    p, m = num_ranks, num_microbatches
    if p < 1 or num_stages != 2 * p:
        raise ScheduleError(
            f"v_schedule (ZB-V) runs exactly 2 stages per rank in a V, got num_stages="
            f"{num_stages} on num_ranks={num_ranks}; set stages_per_rank=2")
    if m < 1:
        raise ScheduleError(f"v_schedule needs num_microbatches >= 1, got {m}")
    n = max(2 * p - 1, m)
    return [[Action(*a) for a in _rank_order(r, p, n) if a[2] < m] for r in range(p)]


def _rank_order(r: int, p: int, n: int) -> list[tuple]:
    """Rank ``r``'s handcrafted order for ``n >= 2p-1`` microbatches, as ``(stage, kind, mb)``."""
    stage, order = (r, 2 * p - 1 - r), []
    done = {F: [0, 0], I: [0, 0], W: [0, 0]}  # per kind, per chunk: microbatches emitted
    f, i, w = done[F], done[I], done[W]

    def run(chunk, *kinds):
        for kind in kinds:
            order.append((stage[chunk], kind, done[kind][chunk]))
            done[kind][chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run(0, F)
    for _ in range(r):
        run(1, F)
        run(0, F)
    for _ in range(p - r):
        run(1, F, I, W)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run(0, F)
        run(0, I, W)
        run(1, F, I, W)
    for _ in range(r):
        run(0, I)
        run(1, I)
    for _ in range(p - r):
        run(0, I, W)
    while w[1] < i[1]:
        run(1, W)
    while w[0] < i[0]:
        run(0, W)
    return order


@hookimpl
def pp_register_schedules(register):
    register("v_schedule", ScheduleDef(
        generate=v_schedule, aliases=("zbv", "zb_v", "ZBVZeroBubble", "ScheduleZBVZeroBubble"),
        placement="v", stages_per_rank=2, variable_stages_per_rank=False,
        description="ZB-V (torch ZBVZeroBubble): V placement, I/W split, 1F1B memory, any m"))
