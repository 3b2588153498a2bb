"""The worked examples of ``tests/fixtures/reference_examples.py``, replayed.

Each built-in schedule plugin must reproduce the reference's per-rank order action for action, and
the unit-cost figures (``F = I = W = 1``, ``B = 2``, no communication) the reference measured.
DualPipeV's overlapped pairs ``(aF;bB)`` are compared as their two halves, forward first: pp-core's
IR has no composite action (see ``pp_core_builtins.schedules.dualpipe_v``). Not replayed: the
sail-sg greedy ZB-V (pp-core's ``v_schedule`` is torch's handcrafted ZB-V) and bidirectional
DualPipe (not built in).
"""

import pytest

from pp_core.schedule.build import build_schedule
from pp_core.schedule.simulate import simulate
from pp_core.testing import plugins_with
from tests.fixtures.reference_examples import EXAMPLES, make_schedule

MODULES = ("gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble",
           "zb_h2", "v_schedule", "v_half", "v_min", "dualpipe_v")

# The example (tests/fixtures/reference_examples.py) each built-in schedule replays, as
# title -> (schedule, stages_per_rank); num_ranks and num_microbatches come from its rows.
REPLAYED = {
    "GPipe p=4 m=4": ("gpipe", 1),
    "1F1B p=4 m=8": ("1f1b", 1),
    "Interleaved1F1B p=2 m=4 v=2": ("interleaved_1f1b", 2),
    "Interleaved1F1B p=4 m=8 v=2": ("interleaved_1f1b", 2),
    "LoopedBFS p=2 m=4 v=2": ("looped_bfs", 2),
    "LoopedBFS p=4 m=8 v=2": ("looped_bfs", 2),
    "ZB-H1 p=4 m=8": ("zero_bubble", 1),
    "ZB-H2 (reconstruction) p=4 m=8": ("zb_h2", 1),
    "InterleavedZeroBubble p=2 m=4 v=2": ("zero_bubble", 2),
    "InterleavedZeroBubble p=4 m=8 v=2": ("zero_bubble", 2),
    "ZBV p=2 m=4": ("v_schedule", 2),
    "ZBV p=4 m=8": ("v_schedule", 2),
    "V-Half p=4 m=8": ("v_half", 2),
    "V-Min p=4 m=8": ("v_min", 2),
    "DualPipeV p=2 m=4": ("dualpipe_v", 2),
    "DualPipeV p=4 m=8": ("dualpipe_v", 2),
}
BY_TITLE = {example["title"]: example for example in EXAMPLES}


# The reference replays DualPipeV's overlapped pairs as composites that start when both halves are
# ready; pp-core runs the halves in sequence, each as soon as it is ready, so the forward of a pair
# may start before the backward's input arrives: same order, shorter makespan (the reference's
# "no overlap" figures are 26/2 and 54/6).
FLATTENED_FIGURES = {"DualPipeV p=2 m=4": (25, 1, 1), "DualPipeV p=4 m=8": (51, 3, 3)}


@pytest.fixture(scope="module")
def plugins():
    return plugins_with(*(f"pp_core_builtins.schedules.{module}" for module in MODULES))


def flat(row: str) -> str:
    """``"(0F3;3B1)"`` -> ``"0F3 3B1"``: an overlapped pair as its two halves, forward first."""
    return row.replace("(", "").replace(")", "").replace(";", " ")


@pytest.mark.parametrize("title", list(REPLAYED))
def test_reference_example_order_and_figures(plugins, title):
    ex, (name, stages_per_rank) = BY_TITLE[title], REPLAYED[title]
    schedule = build_schedule(name, num_ranks=len(ex["rows"]),
                              num_microbatches=make_schedule(ex).num_microbatches,
                              stages_per_rank=stages_per_rank, plugins=plugins)
    assert schedule.rows() == [flat(row) for row in ex["rows"]]
    sim = simulate(schedule)
    figures = FLATTENED_FIGURES.get(title, (ex["makespan"], ex["bubble"], ex["span_bubble"]))
    assert (sim.makespan, sim.bubble, sim.span_bubble) == figures
    assert sim.peak_activations == ex["peaks"]
