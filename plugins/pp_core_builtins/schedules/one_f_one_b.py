"""1F1B (PipeDream-Flush): a warm-up of forwards, then one backward, one forward, ...

Source: Narayanan et al. 2021 (arXiv:2006.09503); Megatron-LM
``forward_backward_pipelining_without_interleaving``; torch ``Schedule1F1B``. Same bubble as
GPipe, ``(p-1)(F+B)``, but rank ``r`` never holds more than ``p - r`` microbatches.
Deviation from torch: torch refuses ``num_microbatches < num_ranks`` (its runtime loop hung at
m=1, torchtitan #775); the order itself is valid there (warm-up ``min(m, p-r)``), so it is kept.

    num_ranks=3, num_stages=3, num_microbatches=4
    rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
"""

from pp_core import Action, B, F, ScheduleDef, hookimpl

__all__ = ["one_f_one_b"]


def one_f_one_b(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """Rank ``r`` warms up with ``w = min(m, p-r)`` forwards, then ``B(j)`` / ``F(j+w)`` pairs."""
    p, m = num_ranks, num_microbatches
    orders = []
    for r in range(p):
        w = min(m, p - r)
        order = [Action(r, F, k) for k in range(w)]
        for j in range(m):
            order.append(Action(r, B, j))
            if j + w < m:
                order.append(Action(r, F, j + w))
        orders.append(order)
    return orders


@hookimpl
def pp_register_schedules(register):
    register("1f1b", ScheduleDef(
        generate=one_f_one_b, aliases=("Schedule1F1B", "one_f_one_b"), placement="loop",
        stages_per_rank=1, variable_stages_per_rank=False,
        description="1F1B: warm-up, then alternate backward/forward; memory p-r, any m"))
