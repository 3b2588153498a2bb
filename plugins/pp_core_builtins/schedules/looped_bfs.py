"""Looped BFS (breadth first): every microbatch through one local stage before the next.

Source: Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism" (arXiv:2211.05953); torch
``ScheduleLoopedBFS``, whose order this reproduces. Loop placement (rank ``r`` holds
``r, r+p, ...``); each rank runs all forwards of its first stage, then of its second, ..., then all
backwards in reverse stage order and, like torch, decreasing microbatch order. Same bubble as
interleaved 1F1B, GPipe's memory (``v·m`` chunk activations), no constraint on ``m``; each stage's
weights are used in one burst per direction, which suits FSDP. One stage per rank is refused
(that is GPipe).

    num_ranks=2, num_stages=4, num_microbatches=3
    rank 0: 0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0
    rank 1: 1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0
"""

from pp_core import Action, B, F, ScheduleDef, ScheduleError, hookimpl

__all__ = ["looped_bfs"]


def looped_bfs(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """Per rank: forwards stage by stage, then backwards in reverse stage and microbatch order."""
    p, m = num_ranks, num_microbatches
    if num_stages // p < 2:
        raise ScheduleError(
            f"looped_bfs needs a whole number >= 2 of stages per rank, got num_stages={num_stages}"
            f" on num_ranks={num_ranks}; set stages_per_rank >= 2, or use 'gpipe' for one stage "
            f"per rank (the same order)")
    orders = []
    for r in range(p):
        stages = range(r, num_stages, p)
        order = [Action(s, F, k) for s in stages for k in range(m)]
        order += [Action(s, B, k) for s in reversed(stages) for k in range(m - 1, -1, -1)]
        orders.append(order)
    return orders


@hookimpl
def pp_register_schedules(register):
    register("looped_bfs", ScheduleDef(
        generate=looped_bfs, aliases=("LoopedBFS", "ScheduleLoopedBFS"), placement="loop",
        stages_per_rank=2, variable_stages_per_rank=True,
        description="breadth-first looped schedule (torch LoopedBFS); memory v*m, any m"))
