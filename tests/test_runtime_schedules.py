"""Every built-in schedule (and a CSV written by torch) on 2 gloo ranks equals one process.

For each: the loss the last rank returns is the mean microbatch loss of the unsplit model on the
same batch, and every parameter's gradient is allclose (fp32, atol 1e-6 relative to the
gradient's magnitude) to the unsplit model's, summed over microbatches or averaged with
``scale_grads_in_schedule=True``; for an ``nn.Sequential`` MLP and for the demo GPT.
"""

from __future__ import annotations

import pytest

from _dist import DistPool
from _runtime_cases import TORCH_ZB_CSV, SCHEDULES, check, check_schedule_mlp, train_case

NUM_RANKS = 2


@pytest.fixture(scope="module")
def pool():
    with DistPool(NUM_RANKS) as ranks:
        yield ranks


@pytest.mark.parametrize("scale", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("num_microbatches", [NUM_RANKS, 2 * NUM_RANKS])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_one_process_mlp(pool, schedule, num_microbatches, scale):
    check_schedule_mlp(pool, schedule, num_microbatches, scale)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_one_process_gpt(pool, schedule):
    check(pool.run(train_case, schedule, 2 * NUM_RANKS, False, kind="gpt", layers=4, steps=2))


@pytest.mark.parametrize("name, scale", [("ignored", False), (None, True)],
                         ids=["a-name-the-csv-overrides-sum", "no-name-mean"])
def test_torch_written_csv_schedule(pool, name, scale):
    check(pool.run(train_case, name, 4, scale, csv_text=TORCH_ZB_CSV), num_params=16)
