"""DualPipeV: DualPipe "cut in half" on a V placement; forward of one chunk overlapped with the
full backward of the other in the steady state, ``I``/``W`` split only at the edges.

Source: DeepSeek ``DualPipe/dualpipe/dualpipev.py`` (``DualPipeV.step``) and README; Sea AI Lab's
"cut-in-half" note; torch ``ScheduleDualPipeV``, whose order this reproduces. Bubble
``(p-1)(F&B + B - 3W)``, peak ``2p+1`` chunk activations; needs ``m >= 2p`` as DeepSeek and torch.
pp-core's IR has no composite action: torch's ``(aF;bB)OVERLAP_F_B`` pair is written as its two
halves, forward first (what torch's runtime does without a registered overlap function); both
halves are ready at that point, so the order stays deadlock free.

    num_ranks=2, num_stages=4, num_microbatches=4
    rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
    rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
"""

from collections import deque

from pp_core import Action, B, F, I, ScheduleDef, ScheduleError, W, hookimpl

__all__ = ["dualpipe_v"]


def dualpipe_v(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """torch's ``ScheduleDualPipeV`` order, overlapped pairs flattened to forward, backward."""
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipe_v needs num_microbatches >= 2 * num_ranks = {2 * p} (DeepSeek and torch "
            f"assert it), got {m}; nearest valid: {2 * p}, or use 'v_schedule', which takes any "
            f"count")
    return [_rank_order(r, p, m) for r in range(p)]


def _rank_order(r: int, p: int, m: int) -> list[Action]:
    stage, order = (r, 2 * p - 1 - r), []
    fwd, bwd = [0, 0], [0, 0]  # next forward / backward microbatch of each chunk
    pending_w = deque()  # (stage, microbatch) of each I whose W is still to run, oldest first

    def run_f(chunk):
        order.append(Action(stage[chunk], F, fwd[chunk]))
        fwd[chunk] += 1

    def run_b(chunk, split=False):
        order.append(Action(stage[chunk], I if split else B, bwd[chunk]))
        if split:
            pending_w.append((stage[chunk], bwd[chunk]))
        bwd[chunk] += 1

    def run_w():
        s, k = pending_w.popleft()
        order.append(Action(s, W, k))

    def overlap(f_chunk, b_chunk):  # torch OVERLAP_F_B(F(f_chunk), B(b_chunk)), run in sequence
        run_f(f_chunk)
        run_b(b_chunk)

    for _ in range(2 * (p - r - 1)):
        run_f(0)
    for _ in range(r + 1):
        run_f(0)
        run_f(1)
    for _ in range(p - r - 1):
        run_b(1, split=True)
        run_w()
        run_f(1)
    for step in range(m - 2 * p + r + 1):
        if step == 0 and r == p - 1:  # deliberately not overlapped, as in DeepSeek's code
            run_f(0)
            run_b(1)
        else:
            overlap(0, 1)
        overlap(1, 0)
    for _ in range(p - r - 1):
        run_b(1)
        overlap(1, 0)
    split = False
    for step in range(r + 1):
        if step == (r + 1) // 2 and r % 2 == 1:
            split = True
        run_b(1, split)
        if step == (r + 1) // 2 and r % 2 == 0:
            split = True
        run_b(0, split)
    for _ in range(p - r - 1):
        run_w()
        run_b(0, split=True)
    for _ in range(r + 1):
        run_w()
    return order


@hookimpl
def pp_register_schedules(register):
    register("dualpipe_v", ScheduleDef(
        generate=dualpipe_v, aliases=("DualPipeV", "ScheduleDualPipeV"), placement="v",
        stages_per_rank=2, variable_stages_per_rank=False,
        description="DeepSeek DualPipeV (torch ScheduleDualPipeV), overlap pairs flattened; "
                    "m >= 2p"))
