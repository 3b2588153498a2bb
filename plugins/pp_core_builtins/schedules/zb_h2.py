"""ZB-H2: zero bubble with up to ``2p-1`` microbatches in flight (a reconstruction).

Source: Qi et al., "Zero Bubble Pipeline Parallelism" (arXiv:2401.10241) section 2.2, which gives
ZB-H2 only as a figure; this is a deterministic greedy list scheduler, run once at unit costs. Rank
``r`` warms up with ``2(p-r)-1`` forwards, the steady state is ``F, I, W`` per microbatch without
gaps, and ``W``s slide to the tail: span bubble ``(p-1)(F+I-2W)`` (0 at ``F = I = W``), peak
``2p-1``. Valid for any ``m``; zero bubble needs ``m >= 2p-1``. The rule: "the rank whose
earliest-ready action starts first goes next (ties: lowest rank; a rank prefers I, then F, then
W)"; with unit costs that is a time-stepped replay: at each step every rank, lowest first, runs its
ready I, else F, else W.

    num_ranks=3, num_stages=3, num_microbatches=5
    rank 0: 0F0 0F1 0F2 0F3 0F4 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4
    rank 1: 1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1I3 1W1 1I4 1W2 1W3 1W4
    rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2W1 2W2 2W3 2W4
"""

from pp_core import Action, F, I, ScheduleDef, ScheduleError, W, hookimpl

__all__ = ["zb_h2"]


def zb_h2(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """Greedy unit-cost list schedule with ``2p-1`` in-flight microbatches per rank."""
    p, m = num_ranks, num_microbatches
    cap = 2 * p - 1
    f_end = [[] for _ in range(p)]  # f_end[r][k]: end time of F(r, k); likewise i_end for I
    i_end = [[] for _ in range(p)]
    num_w = [0] * p
    orders = [[] for _ in range(p)]
    done = t = 0
    while done < 3 * m * p:
        if t > 6 * (m + p):
            raise ScheduleError(f"zb_h2 got stuck at num_ranks={p}, num_microbatches={m}; this "
                                f"is a bug in pp_core_builtins.schedules.zb_h2, please report it")
        for r in range(p):  # every rank is free at step t: each action takes one step
            forwards, backwards = f_end[r], i_end[r]
            n_f, n_i = len(forwards), len(backwards)
            grad_in = forwards if r == p - 1 else i_end[r + 1]  # I(r, n_i) needs grad_in[n_i]
            act_in = f_end[r - 1] if r else None  # F(r, n_f) needs act_in[n_f]
            if n_i < n_f and n_i < len(grad_in) and grad_in[n_i] <= t:
                orders[r].append(Action(r, I, n_i))
                backwards.append(t + 1)
            elif (n_f < m and n_f - num_w[r] < cap
                  and (r == 0 or (n_f < len(act_in) and act_in[n_f] <= t))):
                orders[r].append(Action(r, F, n_f))
                forwards.append(t + 1)
            elif num_w[r] < n_i:
                orders[r].append(Action(r, W, num_w[r]))
                num_w[r] += 1
            else:
                continue
            done += 1
        t += 1
    return orders


@hookimpl
def pp_register_schedules(register):
    register("zb_h2", ScheduleDef(
        generate=zb_h2, aliases=("zbh2",), placement="loop", stages_per_rank=1,
        variable_stages_per_rank=False,
        description="zero bubble ZB-H2 (reconstruction): I/W split, 2p-1 memory, any m"))
