"""Megatron's interleaved order, shared by ``interleaved_1f1b``, ``dfs`` and ``zero_bubble``
(not a plugin: no hooks, no entry point).

With loop placement rank ``r`` holds chunks ``c = 0..v-1`` (stages ``c*p + r``). Forwards visit
the chunks group by group: ``group`` microbatches through chunk 0, the same ones through chunk 1,
..., then the next group. torch's group size is ``N = m // (m // p)`` (``p`` when ``p`` divides
``m``), so ``m`` must be a multiple of ``m // p``. Backwards follow the same table with the chunks
reversed. The schedules differ in their checks, their warm-up and how they split the backward.
"""

from pp_core import Action, B, F, ScheduleError


def loop_chunks(name: str, num_stages: int, num_ranks: int) -> int:
    """Stages per rank ``v``, refusing anything but a whole number >= 2."""
    v = num_stages // num_ranks
    if v < 2:
        raise ScheduleError(
            f"{name} needs a whole number >= 2 of stages per rank, got num_stages={num_stages} "
            f"on num_ranks={num_ranks}; set stages_per_rank >= 2, or use '1f1b' for one stage "
            f"per rank")
    return v


def torch_group_fits(m: int, p: int) -> bool:
    """Whether ``m`` microbatches split into torch's groups of ``m // (m // p)``."""
    return m >= 1 and m % max(1, m // p) == 0


def nearest_torch_groups(m: int, p: int) -> str:
    """The closest counts below and above ``m`` that :func:`torch_group_fits`, for messages."""
    lower = next((k for k in range(m - 1, 0, -1) if torch_group_fits(k, p)), None)
    upper = next(k for k in range(max(m + 1, 1), m + p + 2) if torch_group_fits(k, p))
    return f"{lower} or {upper}" if lower else f"{upper}"


def chunk_table(num_microbatches: int, v: int, group: int) -> list[tuple[int, int]]:
    """Virtual microbatch ``j`` -> ``(microbatch, chunk)``: each group visits chunk 0, 1, ..."""
    m = num_microbatches
    return [(k, c) for lo in range(0, m, group) for c in range(v)
            for k in range(lo, min(lo + group, m))]


def interleaved_1f1b_orders(num_ranks: int, v: int, num_microbatches: int,
                            group: int) -> list[list[Action]]:
    """1F1B over the chunk table: warm-up ``(v-1)*group + 2(p-1-r)`` forwards, then one forward
    and one backward by turns, then the remaining backwards."""
    p = num_ranks
    table = chunk_table(num_microbatches, v, group)
    total = len(table)
    orders = []
    for r in range(p):
        fwd = [Action(c * p + r, F, k) for k, c in table]
        bwd = [Action((v - 1 - c) * p + r, B, k) for k, c in table]
        warmup = min(total, (v - 1) * group + 2 * (p - 1 - r))
        order = fwd[:warmup]
        for j in range(total - warmup):
            order.append(fwd[j + warmup])
            order.append(bwd[j])
        order.extend(bwd[total - warmup:])
        orders.append(order)
    return orders
