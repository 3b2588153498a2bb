"""Every built-in schedule (and a CSV written by torch) on 2 gloo ranks equals one process.

For each: the loss the last rank returns is the mean microbatch loss of the unsplit model on the
same batch, and every parameter's gradient is allclose (fp32, atol 1e-6 relative to the
gradient's magnitude) to the unsplit model's, summed over microbatches or averaged with
``scale_grads_in_schedule=True``; for an ``nn.Sequential`` MLP and for the demo GPT; and for a
model whose blocks change the tensor they receive in place (a stage's input, too).
"""

from __future__ import annotations

import pytest

from tests.cases.runtime import TORCH_ZB_CSV, SCHEDULES, check, check_schedule_mlp, train_case

NUM_RANKS = 2


pytestmark = pytest.mark.ranks(NUM_RANKS)


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


@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("schedule, buffer_pool", [
    ("1f1b", False), ("zero_bubble", False), ("1f1b", True), ("v_schedule", True)],
    ids=["full-backward", "split-backward", "buffer-pool", "local-handoff-pool"])
def test_a_stage_changing_its_input_in_place_matches_one_process(pool, op, schedule, buffer_pool):
    """Unsplit, ``x.mul_(2)`` at a stage's start acts on an intermediate tensor and trains; the
    stage's input must behave the same (not be a leaf torch refuses to change in place)."""
    check(pool.run(train_case, schedule, 2 * NUM_RANKS, False, kind=f"in_place_{op}", steps=2,
                   buffer_pool=buffer_pool), num_params=16)
