"""V-Half: a V-placement schedule with about half of 1F1B's activation memory.

Source: Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024, arXiv:2405.15362);
sail-sg ``zbv_greedy.py`` (``--zero-bubble-v-schedule-mem-setup half``), whose order this reproduces
(procedure in ``pp_core_builtins.schedules._controllable_memory``). Rank ``r`` holds stages ``r``
and ``2p-1-r``; the building block puts rank ``r``'s ``F(c0), F(c1), I(c1), I(c0)`` of microbatch 0
at slots ``2r, 3p-2-r, 3p+g+2r-1, 6p+g-2-r`` (``g = 3`` for even ``p``, else 0), one block every 6
slots, then a memory-capped greedy fills and squeezes it. Peak ``2⌊(p+2)/2⌋`` chunk activations
(``⌊(p+2)/2⌋`` full stages), bubble about half of 1F1B's. Any ``m >= 1``.

    num_ranks=2, num_stages=4, num_microbatches=3
    rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0I0 3I1 3W1 3F2 3I2 0I1 3W2 0I2 0W0 0W1 0W2
    rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 1F2 2F2 2I1 1I1 2I2 1I2 2W1 2W2 1W1 1W2
"""

from pp_core import Action, ScheduleDef, hookimpl
from pp_core_builtins.schedules._controllable_memory import controllable_memory_orders

__all__ = ["v_half"]


def v_half(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """The V-Half order of sail-sg's controllable-memory scheduler at unit costs."""
    p, m = num_ranks, num_microbatches
    return controllable_memory_orders(_block(p), m)


def _block(p: int) -> list[list[int]]:
    """Rank r's slots of F(c0), F(c1), I(c1), I(c0) for microbatch 0 (sail-sg's stable pattern)."""
    gap = 3 if p % 2 == 0 else 0
    return [[2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1, 6 * p + gap - 2 - r]
            for r in range(p)]


@hookimpl
def pp_register_schedules(register):
    register("v_half", ScheduleDef(
        generate=v_half, aliases=("vhalf",), placement="v", stages_per_rank=2,
        variable_stages_per_rank=False,
        description="V-Half (controllable memory): V placement, I/W split, ~1/2 of 1F1B's "
                    "memory, any m"))
