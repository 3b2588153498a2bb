"""V-Min: a V-placement schedule with about a third of 1F1B's activation memory.

Source: Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024, arXiv:2405.15362);
sail-sg ``zbv_greedy.py`` (``--zero-bubble-v-schedule-mem-setup min``), whose order this reproduces
(procedure in ``pp_core_builtins.schedules._controllable_memory``). Rank ``r`` holds stages ``r``
and ``2p-1-r``; the building block puts rank ``r``'s ``F(c0), F(c1), I(c1), I(c0)`` of microbatch 0
at slots ``r, 2p-1-r, 2p+g+r, 4p+g-1-r`` (``g = 2`` when 3 divides ``p``, else 0), one block every 6
slots, then a memory-capped greedy fills and squeezes it. Peak ``2⌊(p+4)/3⌋`` chunk activations
(``⌊(p+4)/3⌋`` full stages), bubble about 2/3 of 1F1B's (more when ``F``, ``I``, ``W`` differ). Any
``m >= 1``.

    num_ranks=2, num_stages=4, num_microbatches=3
    rank 0: 0F0 0F1 3F0 3I0 3W0 0I0 0W0 3F1 3I1 3W1 0F2 0I1 0W1 3F2 3I2 3W2 0I2 0W2
    rank 1: 1F0 2F0 2I0 1I0 1F1 2F1 2W0 1W0 2I1 1I1 1F2 2F2 2W1 1W1 2I2 1I2 2W2 1W2
"""

from pp_core import Action, ScheduleDef, hookimpl
from pp_core_builtins.schedules._controllable_memory import controllable_memory_orders

__all__ = ["v_min"]


def v_min(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """The V-Min order of sail-sg's controllable-memory scheduler at unit costs."""
    p, m = num_ranks, num_microbatches
    return controllable_memory_orders(_block(p), m)


def _block(p: int) -> list[list[int]]:
    """Rank r's slots of F(c0), F(c1), I(c1), I(c0) for microbatch 0 (sail-sg's stable pattern)."""
    gap = 2 if p % 3 == 0 else 0
    return [[r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r] for r in range(p)]


@hookimpl
def pp_register_schedules(register):
    register("v_min", ScheduleDef(
        generate=v_min, aliases=("vmin",), placement="v", stages_per_rank=2,
        variable_stages_per_rank=False,
        description="V-Min (controllable memory): V placement, I/W split, ~1/3 of 1F1B's "
                    "memory, any m"))
