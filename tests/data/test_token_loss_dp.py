"""The token-exact loss with data parallelism: pp2 x dp2 on 4 gloo ranks, the dp ranks' halves
of the global batch holding very different numbers of valid targets. With ``dp_group`` the step
counts the valid tokens over both dp ranks (one all-reduce), so the mean over the dp ranks of
``step``'s loss and the FSDP2-reduced gradients equal the unsplit model's on the global batch."""

import pytest

from tests.cases.token import dp_token_case

ATOL = 2e-6


pytestmark = pytest.mark.ranks(4, timeout=180)


@pytest.mark.parametrize("schedule,engine", [("1f1b", "helper"), ("zero_bubble", "helper"),
                                             ("interleaved_1f1b", "replicate")])
def test_pp2_dp2_equals_the_global_batch_loss(pool, schedule, engine):
    results = pool.run(dp_token_case, schedule, engine)
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2 and max(losses) <= 5 * ATOL, losses
    for rank, result in enumerate(results):
        assert result["grad_err"] <= ATOL, f"rank {rank}: gradient differs by {result['grad_err']}"
