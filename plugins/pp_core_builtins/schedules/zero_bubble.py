"""Zero bubble ZB-H1: split backward (``I`` then ``W``), ``W`` postponed to fill the bubbles.

Source: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv:2401.10241) section 2.1,
ZB-H1; torch ``ScheduleInterleavedZeroBubble``, whose order this reproduces for any number of
stages per rank. One stage per rank is ZB-H1: 1F1B's memory (``p`` microbatches on every rank)
and a third of its bubble, ``(p-1)(F+I-W)``. With ``v >= 2`` looped chunks per rank it is torch's
looped generalisation (Megatron's interleaved table, one warm-up forward per hop, ``W`` lagging
``r`` steps); then ``m`` must be a multiple of ``m // p`` as for ``interleaved_1f1b``.

    num_ranks=3, num_stages=3, num_microbatches=4
    rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
    rank 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
    rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
"""

from pp_core import Action, F, I, ScheduleDef, ScheduleError, W, hookimpl
from pp_core_builtins.schedules._interleaved import chunk_table, nearest_torch_groups, torch_group_fits

__all__ = ["zero_bubble"]


def zero_bubble(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """ZB-H1 (one stage per rank) or torch's interleaved zero bubble (``v >= 2``)."""
    p, m = num_ranks, num_microbatches
    v = num_stages // p
    if v > 1 and not torch_group_fits(m, p):
        raise ScheduleError(
            f"zero_bubble with {v} stages per rank needs num_microbatches to be a multiple of "
            f"max(1, num_microbatches // num_ranks) (torch's interleaved rule), got "
            f"num_microbatches={m} with num_ranks={p}; nearest valid: "
            f"{nearest_torch_groups(m, p)} (or use one stage per rank, which takes any count)")
    group = m // max(1, m // p)
    table = chunk_table(m, v, group)
    total = v * m
    orders = []
    for r in range(p):
        fwd = [Action(c * p + r, F, k) for k, c in table]
        back = [((v - 1 - c) * p + r, k) for k, c in table]
        warmup = min(total, (v - 1) * group + (p - 1 - r))
        order = fwd[:warmup]
        for j in range(total):
            if j + warmup < total:
                order.append(fwd[j + warmup])
            order.append(Action(back[j][0], I, back[j][1]))
            if j >= r:
                order.append(Action(back[j - r][0], W, back[j - r][1]))
        order += [Action(s, W, k) for s, k in back[max(0, total - r):]]
        orders.append(order)
    return orders


@hookimpl
def pp_register_schedules(register):
    register("zero_bubble", ScheduleDef(
        generate=zero_bubble,
        aliases=("zb_h1", "zbh1", "InterleavedZeroBubble", "ScheduleInterleavedZeroBubble"),
        placement="loop", stages_per_rank=1, variable_stages_per_rank=True,
        description="zero bubble ZB-H1 (I/W split, 1F1B memory); v>=2: torch "
                    "InterleavedZeroBubble"))
