"""DFS (depth first): Megatron's interleaved 1F1B with its default group size ``N = p``.

Source: Lamy-Poirier 2022 (arXiv:2211.05953) names Megatron's interleaved schedule (Narayanan et
al. SC21, arXiv:2104.04473) "depth first"; PiPPy's ``PipelineScheduleLoopedDFS`` became torch's
``ScheduleInterleaved1F1B``. Orders are byte-identical to ``interleaved_1f1b`` wherever both
accept ``m``; the difference is strictness: a group is always ``p`` microbatches, so ``m`` must be
a multiple of ``p`` (Megatron's default rule), where ``interleaved_1f1b`` relaxes ``N`` as torch
does. Warm-up ``(v-1)p + 2(p-1-r)`` forwards; loop placement, ``v >= 2`` stages per rank.

    num_ranks=2, num_stages=4, num_microbatches=4
    rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
"""

from pp_core import Action, ScheduleDef, ScheduleError, hookimpl
from pp_core_builtins.schedules._interleaved import interleaved_1f1b_orders, loop_chunks

__all__ = ["dfs"]


def dfs(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """Megatron's depth-first order: groups of ``p`` microbatches, each through every chunk."""
    p, m = num_ranks, num_microbatches
    v = loop_chunks("dfs", num_stages, num_ranks)
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(
            f"dfs needs num_microbatches to be a multiple of num_ranks={p} (groups of p "
            f"microbatches, Megatron's rule), got {m}; nearest valid: {nearest} "
            f"('interleaved_1f1b' accepts more counts)")
    return interleaved_1f1b_orders(p, v, m, group=p)


@hookimpl
def pp_register_schedules(register):
    register("dfs", ScheduleDef(
        generate=dfs, aliases=("depth_first", "LoopedDFS", "PipelineScheduleLoopedDFS"),
        placement="loop", stages_per_rank=2, variable_stages_per_rank=True,
        description="depth-first = Megatron interleaved 1F1B with groups of p; m a multiple of p"))
