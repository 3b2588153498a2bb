"""PP x torch data parallelism on 4 gloo ranks (mesh pp 2 x dp 2): the parts are wrapped with
FSDP2's ``fully_shard`` or DDP after ``build_pipeline``, and ``Pipeline.step`` must drive them:
loss and every full gradient equal to one process on the global batch, for every schedule kind
(split backward included), and one reduce-scatter / all-gather per FSDP unit per step."""

import pytest

from tests._dist import DistPool
from tests._fsdp_cases import dp_case
from tests._runtime_cases import SCHEDULES as ALL_SCHEDULES

SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "v_schedule", "dualpipe_v"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def pool():
    with DistPool(4, timeout=180) as pool:
        yield pool


def check(results, units_expected=None):
    losses = [r["loss_err"] for r in results if r["loss_err"] is not None]
    assert len(losses) == 2, "both dp ranks of the last stage's pp rank return the loss"
    assert max(losses) <= ATOL, f"loss differs by {max(losses)}"
    for rank, result in enumerate(results):
        assert result["grad_err"] <= ATOL, f"rank {rank}: gradient differs by {result['grad_err']}"
    names = {n for r in results for n in r["names"]}
    assert len(names) == len([n for r in results[::2] for n in r["names"]])


# every schedule without the receive-buffer pool, the six kinds also with it
CASES = [(s, False) for s in ALL_SCHEDULES] + [(s, True) for s in SCHEDULES]


@pytest.mark.parametrize("schedule,pool_buffers", CASES,
                         ids=[f"{s}-{'buffer_pool' if p else 'plain'}" for s, p in CASES])
def test_fsdp_gradients_equal_one_process(pool, schedule, pool_buffers):
    results = pool.run(dp_case, schedule, "fsdp", pool=pool_buffers)
    check(results)
    for rank, result in enumerate(results):
        # one reduce-scatter and (reshard_after_forward=False) one all-gather per unit per step
        assert result["counts"] == {"reduce_scatter_single": result["units"],
                                    "all_gather_single": result["units"]}, (rank, result)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_fsdp_gpt_reshard_after_forward(pool, schedule):
    results = pool.run(dp_case, schedule, "fsdp", kind="gpt", reshard_after_forward=True)
    check(results)
    for result in results:  # the microbatch count changes the all-gathers, never the reductions
        assert result["counts"]["reduce_scatter_single"] == result["units"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_ddp_gradients_equal_one_process(pool, schedule):
    check(pool.run(dp_case, schedule, "ddp"))


def test_ddp_with_split_backward_is_refused(pool):
    outcomes = pool.run_outcomes(dp_case, "zero_bubble", "ddp")
    assert all(not o.ok and o.error == "ConfigError" for o in outcomes), outcomes
    assert "replicate() or fully_shard()" in outcomes[0].message


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "dualpipe_v"])
@pytest.mark.parametrize("engine", ["helper", "replicate"])
def test_apply_data_parallel(pool, schedule, engine):
    """The helper: FSDP2 per block then per part, or replication (DDP semantics) through the same
    driver - split backward included, where DDP itself is refused."""
    results = pool.run(dp_case, schedule, engine, kind="gpt")
    check(results)
    for result in results:
        counts = result["counts"]
        if engine == "helper":
            assert counts["reduce_scatter_single"] == result["units"], result
