"""The multi-rank test pool: a case's timeout measures the case, not the start of its ranks; a
return value that cannot be sent back is an error at once, not a hang.

``pytest -n 12`` on 16 cores once reported test_runtime_errors.py::test_missing_target_is_refused
as a hang: 36 ranks importing torch at once made a cold start of the pool's processes and
process group take longer than the case's 60 s. Starting is bounded separately
(``startup_timeout``); a case that really hangs is still reported as one.
"""

from __future__ import annotations

import time

import pytest

from pp_core.testing import DistPool, RankError


def rank_of():
    import torch.distributed as dist

    return dist.get_rank()


def stall_on_rank_1(seconds: float):
    if rank_of() == 1:
        time.sleep(seconds)
    return rank_of()


@pytest.mark.ranks
def test_a_cold_start_is_not_counted_against_the_case_timeout_but_a_hang_is():
    # starting 2 processes that import torch and join a process group takes well over 0.5 s
    with DistPool(2, timeout=0.5) as pool:
        assert pool.run(rank_of) == [0, 1]
        with pytest.raises(RankError, match=r"did not finish on every rank within 0.5 s \(a hang\)"):
            pool.run(stall_on_rank_1, 30)
        assert pool.run(stall_on_rank_1, 0) == [0, 1]  # a fresh pool (a cold start) serves again


@pytest.mark.ranks
def test_a_start_that_takes_too_long_is_reported_as_such():
    with DistPool(2, timeout=60, startup_timeout=0.01) as pool:
        with pytest.raises(RankError, match="did not start on every rank within 0.01 s"):
            pool.run(rank_of)


def returns_a_tensor_that_requires_grad():
    import torch

    return torch.ones(2, requires_grad=True) * 2


@pytest.mark.ranks
def test_a_return_value_that_cannot_be_sent_is_an_error_not_a_hang():
    with DistPool(2, timeout=20) as pool:  # before: RankError "did not finish ... (a hang)"
        outcomes = pool.run_outcomes(returns_a_tensor_that_requires_grad)
        assert all(not o.ok and "cannot be sent to the test process" in o.message
                   and "requires_grad" in o.message for o in outcomes), outcomes
        assert pool.run(rank_of) == [0, 1]  # the pool serves on
