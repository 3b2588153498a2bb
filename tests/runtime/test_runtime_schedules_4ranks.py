"""Every built-in schedule on 4 gloo ranks (2 stages per rank where the schedule loops or is V)
equals one process: loss and every gradient, microbatches in {4, 8}, gradient sum and mean."""

from __future__ import annotations

import pytest

from tests.cases.runtime import SCHEDULES, check, check_schedule_mlp, train_case

NUM_RANKS = 4


pytestmark = pytest.mark.ranks(NUM_RANKS)


@pytest.mark.parametrize("scale", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("num_microbatches", [NUM_RANKS, 2 * NUM_RANKS])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_one_process_mlp(pool, schedule, num_microbatches, scale):
    check_schedule_mlp(pool, schedule, num_microbatches, scale)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble", "v_schedule"])
def test_schedule_matches_one_process_gpt(pool, schedule):
    check(pool.run(train_case, schedule, NUM_RANKS, False, kind="gpt", layers=8, steps=2))
