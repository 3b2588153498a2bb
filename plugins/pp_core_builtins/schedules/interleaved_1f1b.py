"""Interleaved 1F1B (Megatron virtual pipeline stages): 1F1B over looped chunks, depth first.

Source: Narayanan et al. SC21 (arXiv:2104.04473); Megatron-LM
``forward_backward_pipelining_with_interleaving``; torch ``ScheduleInterleaved1F1B``, whose order
this reproduces action for action. Rank ``r`` holds stages ``r, r+p, ...`` (loop placement); a
group of ``N`` microbatches passes through chunk 0, then chunk 1, ..., then the next group. The
group size is torch's ``N = m // (m // p)`` (= ``p``, Megatron's default, when ``p`` divides
``m``), so ``m`` must be a multiple of ``m // p``. Warm-up ``(v-1)N + 2(p-1-r)`` forwards; bubble
``(p-1)(F+B)`` per chunk action. One stage per rank is refused: this warm-up is not 1F1B's.

    num_ranks=2, num_stages=4, num_microbatches=4
    rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
"""

from pp_core import Action, ScheduleDef, ScheduleError, hookimpl
from pp_core_builtins.schedules._interleaved import (interleaved_1f1b_orders, loop_chunks,
                                                    nearest_torch_groups, torch_group_fits)

__all__ = ["interleaved_1f1b"]


def interleaved_1f1b(num_stages: int, num_microbatches: int,
                     num_ranks: int) -> list[list[Action]]:
    """The Megatron/torch interleaved order with torch's automatic group size ``N``."""
    p, m = num_ranks, num_microbatches
    v = loop_chunks("interleaved_1f1b", num_stages, num_ranks)
    if not torch_group_fits(m, p):
        raise ScheduleError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of "
            f"max(1, num_microbatches // num_ranks) (torch's rule: groups of "
            f"N = m // (m // p) microbatches), got num_microbatches={m} with num_ranks={p}; "
            f"nearest valid: {nearest_torch_groups(m, p)}")
    return interleaved_1f1b_orders(p, v, m, group=m // max(1, m // p))


@hookimpl
def pp_register_schedules(register):
    register("interleaved_1f1b", ScheduleDef(
        generate=interleaved_1f1b,
        aliases=("Interleaved1F1B", "ScheduleInterleaved1F1B"),
        placement="loop", stages_per_rank=2, variable_stages_per_rank=True,
        description="Megatron/torch interleaved 1F1B over v>=2 looped chunks per rank; "
                    "m a multiple of m//p"))
