"""Frozen parameters in the pipeline: every built-in schedule on 2 gloo ranks equals one process,
and the work frozen stages need not do is not done.

A stage before the first trainable one (the frozen prefix) runs no backward action, and no
gradient message is sent for its outputs; a later stage with nothing to train runs no ``W``.
Frozen parameters get no ``.grad`` and stay bit for bit what they were; trainable ones follow
the unsplit model's SGD steps.
"""

from __future__ import annotations

import pytest

from tests.cases.frozen import check_frozen, freeze_on_rank_1, frozen_case, parse
from tests.cases.runtime import SCHEDULES

NUM_RANKS = 2
# the MLP's 8 layers; 1 stage per rank: [0-3][4-7], 2 per rank: [0,1][2,3][4,5][6,7]
PATTERNS = {
    "prefix": (0, 1, 2, 3, 6, 7),  # frozen prefix; with 4 stages the last one has nothing to train
    "suffix": (4, 5, 6, 7),        # stages after the trainable ones: input gradients only, no W
}


pytestmark = pytest.mark.ranks(NUM_RANKS)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_frozen_layers_match_one_process(pool, schedule, pattern):
    results = pool.run(frozen_case, schedule, 2 * NUM_RANKS, frozen=PATTERNS[pattern])
    check_frozen(results)
    trainable = results[0]["trainable"]
    assert not all(trainable), trainable


def test_frozen_prefix_runs_no_backward_and_sends_no_gradient(pool):
    """1F1B, stage 0 frozen: rank 0 runs forwards only and neither rank moves a gradient."""
    results = pool.run(frozen_case, "1f1b", 4, frozen=(0, 1, 2, 3))
    check_frozen(results)
    assert results[0]["trainable"] == (False, True)
    kinds = [sorted({kind for _, kind, _ in map(parse, r["actions"])}) for r in results]
    assert kinds == [["F", "SEND_F"], ["B", "F", "RECV_F"]], kinds
    assert [(r["sent"], r["received"]) for r in results] == [([], [])] * 2


def test_frozen_with_the_receive_buffer_pool(pool):
    for schedule in ("1f1b", "zero_bubble", "v_schedule"):
        check_frozen(pool.run(frozen_case, schedule, 4, frozen=PATTERNS["prefix"],
                              buffer_pool=True))


def test_everything_frozen_runs_forwards_only(pool):
    results = pool.run(frozen_case, "1f1b", 4, frozen=tuple(range(8)))
    check_frozen(results)
    for result in results:
        assert {kind for _, kind, _ in map(parse, result["actions"])} <= {"F", "SEND_F", "RECV_F"}


def test_ranks_that_froze_differently_are_refused_on_every_rank(pool):
    for rank, (name, message) in enumerate(pool.run(freeze_on_rank_1)):
        assert name == "ConfigError", (rank, name, message)
        assert "frozen parameters (requires_grad=False) differs" in message, message



def test_unfreezing_after_the_build_is_refused():
    """One process (every stage local): the program was made for frozen stages, so a step after
    unfreezing them is refused with the fix, not run with gradients silently missing."""
    from tests.cases.frozen import freeze_layers
    from tests.cases.runtime import batch, mlp, mse
    from pp_core import ConfigError, PipelineConfig, build_pipeline

    model = mlp(8)
    freeze_layers(model, {0, 1, 2, 3})
    pipe = build_pipeline(model, PipelineConfig(pp_batch_size=4, pp_microbatch_size=2,
                                                loss_fn=mse, layers_per_stage=4,
                                                pp_schedule="interleaved_1f1b"))
    pipe.step(*batch("mlp", 4)[:1], target=batch("mlp", 4)[1])
    for part in pipe.model_parts:
        part.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"stage 0 was built frozen .* before build_pipeline"):
        pipe.step(*batch("mlp", 4)[:1], target=batch("mlp", 4)[1])
