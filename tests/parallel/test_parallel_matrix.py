"""Every schedule x {AC full, AC selective, compile, AC + compile} x pool on/off equals the
unsplit eager model on one process, on 2 gloo ranks (the matrix of docs/activation_and_compile.md).

Eager AC is exact (the recompute is bitwise the forward). Compiled cells use the ``aot_eager``
backend for the whole matrix: it builds the same autograd structure as inductor (one
``CompiledFunctionBackward`` node per block, donated buffers), in seconds; the split-backward
schedules also run with inductor (the C++ compile takes tens of seconds on this CPU, once per
module since the ranks keep their compiled code), within 1e-5 relative. The same runs count each
block's forward calls: one forward plus one recompute per microbatch with AC, split backward or
not.
"""

from __future__ import annotations

import pytest

from tests.cases.parallel import matrix_case
from tests.cases.runtime import SCHEDULES

SPLIT_BACKWARD = ["zero_bubble", "zb_h2", "v_schedule", "v_half", "v_min", "dualpipe_v"]
CELLS = [("full", None), ("selective", None), ("none", "aot_eager"), ("full", "aot_eager"),
         ("selective", "aot_eager")]


pytestmark = pytest.mark.ranks(2, timeout=600)


def _check(results, tolerance: float) -> None:
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 1 and losses[0] <= 1e-6, f"loss differs by {losses}"
    for rank, result in enumerate(results):
        assert result["grad_err"] <= tolerance, \
            f"rank {rank}: gradient differs by {result['grad_err']} (relative)"


@pytest.mark.parametrize("pool_on", [False, True], ids=["no_pool", "pool"])
@pytest.mark.parametrize("ac,backend", CELLS,
                         ids=["ac_full", "ac_selective", "compile", "ac_full+compile",
                              "ac_selective+compile"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_matrix_matches_unsplit_eager(pool, schedule, ac, backend, pool_on):
    results = pool.run(matrix_case, schedule, ac, backend, pool_on)
    _check(results, 1e-6)  # as the schedule tests: summation order differs by schedule
    for result in results:
        if backend is None:  # one forward + one recompute per block and microbatch
            assert result["calls"] == [2 * result["num_microbatches"]] * len(result["calls"])
        else:  # compiled code never runs the Python forward (no silent fall-back to eager)
            assert result["calls"] == [0] * len(result["calls"])


@pytest.mark.parametrize("ac", ["none", "full"], ids=["compile", "ac_full+compile"])
@pytest.mark.parametrize("schedule", ["zero_bubble", "v_schedule", "dualpipe_v"])
def test_split_backward_with_inductor(pool, schedule, ac):
    results = pool.run(matrix_case, schedule, ac, "inductor", False)
    _check(results, 1e-5)
    assert all(result["calls"] == [0] * len(result["calls"]) for result in results)
