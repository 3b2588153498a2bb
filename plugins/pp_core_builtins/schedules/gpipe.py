"""GPipe: every forward, then every backward (fill-drain).

Source: Huang et al. 2019, "GPipe" (arXiv:1811.06965); torch ``ScheduleGPipe``. The simplest
schedule and the one to use when there are fewer microbatches than ranks: every rank keeps all
``num_microbatches`` activations alive, bubble ``(p-1)(F+B)``. Backwards run in increasing
microbatch order, as torch does.

    num_ranks=2, num_stages=2, num_microbatches=3
    rank 0: 0F0 0F1 0F2 0B0 0B1 0B2
    rank 1: 1F0 1F1 1F2 1B0 1B1 1B2
"""

from pp_core import Action, B, F, ScheduleDef, hookimpl

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int, num_ranks: int) -> list[list[Action]]:
    """Rank ``r``: ``F(r,0..m-1)`` then ``B(r,0..m-1)``. Any ``num_microbatches >= 1``."""
    mbs = range(num_microbatches)
    return [[Action(r, F, k) for k in mbs] + [Action(r, B, k) for k in mbs]
            for r in range(num_ranks)]


@hookimpl
def pp_register_schedules(register):
    register("gpipe", ScheduleDef(
        generate=gpipe, aliases=("ScheduleGPipe",), placement="loop", stages_per_rank=1,
        variable_stages_per_rank=False,
        description="GPipe: all forwards, then all backwards; memory m, any m"))
