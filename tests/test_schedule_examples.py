"""The worked examples of the schedule reference (docs/reference, section 5), replayed.

Each built-in schedule plugin must reproduce the reference's per-rank order action for action, and
the unit-cost figures (``F = I = W = 1``, ``B = 2``, no communication) the reference measured.
DualPipeV's overlapped pairs ``(aF;bB)`` are compared as their two halves, forward first: pp-core's
IR has no composite action (see ``pp_schedules.dualpipe_v``). Not replayed: the sail-sg greedy ZB-V
(pp-core's ``v_schedule`` is torch's handcrafted ZB-V) and bidirectional DualPipe (not built in).
"""

from typing import NamedTuple

import pytest

from pp_core.schedule.build import build_schedule
from pp_core.schedule.simulate import simulate
from pp_core.testing import plugins_with

MODULES = ("gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "dfs", "zero_bubble",
           "zb_h2", "v_schedule", "v_half", "v_min", "dualpipe_v")


class Example(NamedTuple):
    schedule: str
    num_ranks: int
    stages_per_rank: int
    num_microbatches: int
    makespan: int
    bubble: int
    span_bubble: int
    peaks: list
    rows: list


EXAMPLES = {
    'GPipe p=4 m=4': Example(
        'gpipe', num_ranks=4, stages_per_rank=1, num_microbatches=4,
        makespan=21, bubble=9, span_bubble=9, peaks=[4, 4, 4, 4],
        rows=[
            '0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3',
            '1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3',
            '2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3',
            '3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3',
        ]),
    '1F1B p=4 m=8': Example(
        '1f1b', num_ranks=4, stages_per_rank=1, num_microbatches=8,
        makespan=33, bubble=9, span_bubble=9, peaks=[4, 3, 2, 1],
        rows=[
            '0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7',
            '1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7',
            '2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7',
            '3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7',
        ]),
    'Interleaved1F1B p=2 m=4 v=2': Example(
        'interleaved_1f1b', num_ranks=2, stages_per_rank=2, num_microbatches=4,
        makespan=27, bubble=3, span_bubble=3, peaks=[5, 3],
        rows=[
            '0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3',
            '1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3',
        ]),
    'Interleaved1F1B p=4 m=8 v=2': Example(
        'interleaved_1f1b', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=57, bubble=9, span_bubble=9, peaks=[11, 9, 7, 5],
        rows=[
            '0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 '
            '0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7',
            '1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 '
            '1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7',
            '2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 '
            '2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7',
            '3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 '
            '7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7',
        ]),
    'LoopedBFS p=2 m=4 v=2': Example(
        'looped_bfs', num_ranks=2, stages_per_rank=2, num_microbatches=4,
        makespan=27, bubble=3, span_bubble=3, peaks=[8, 8],
        rows=[
            '0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0',
            '1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0',
        ]),
    'LoopedBFS p=4 m=8 v=2': Example(
        'looped_bfs', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=57, bubble=9, span_bubble=9, peaks=[16, 16, 16, 16],
        rows=[
            '0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 4F0 4F1 4F2 4F3 4F4 4F5 4F6 4F7 4B7 4B6 4B5 4B4 4B3 '
            '4B2 4B1 4B0 0B7 0B6 0B5 0B4 0B3 0B2 0B1 0B0',
            '1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 5F0 5F1 5F2 5F3 5F4 5F5 5F6 5F7 5B7 5B6 5B5 5B4 5B3 '
            '5B2 5B1 5B0 1B7 1B6 1B5 1B4 1B3 1B2 1B1 1B0',
            '2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 6F0 6F1 6F2 6F3 6F4 6F5 6F6 6F7 6B7 6B6 6B5 6B4 6B3 '
            '6B2 6B1 6B0 2B7 2B6 2B5 2B4 2B3 2B2 2B1 2B0',
            '3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 7F0 7F1 7F2 7F3 7F4 7F5 7F6 7F7 7B7 7B6 7B5 7B4 7B3 '
            '7B2 7B1 7B0 3B7 3B6 3B5 3B4 3B3 3B2 3B1 3B0',
        ]),
    'ZB-H1 p=4 m=8': Example(
        'zero_bubble', num_ranks=4, stages_per_rank=1, num_microbatches=8,
        makespan=27, bubble=3, span_bubble=3, peaks=[4, 4, 4, 4],
        rows=[
            '0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 '
            '0W6 0I7 0W7',
            '1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 '
            '1I7 1W6 1W7',
            '2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 '
            '2W5 2W6 2W7',
            '3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 '
            '3W5 3W6 3W7',
        ]),
    'ZB-H2 (reconstruction) p=4 m=8': Example(
        'zb_h2', num_ranks=4, stages_per_rank=1, num_microbatches=8,
        makespan=27, bubble=3, span_bubble=0, peaks=[7, 7, 7, 7],
        rows=[
            '0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0I1 0F7 0I2 0W1 0I3 0W2 0I4 0W3 0I5 0W4 0I6 0W5 '
            '0W6 0I7 0W7',
            '1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1W0 1I3 1F7 1I4 1W1 1I5 1W2 1I6 1W3 1W4 1I7 '
            '1W5 1W6 1W7',
            '2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2W0 2I5 2F7 2I6 2W1 2W2 2I7 2W3 2W4 '
            '2W5 2W6 2W7',
            '3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 3W2 3W3 3W4 '
            '3W5 3W6 3W7',
        ]),
    'InterleavedZeroBubble p=2 m=4 v=2': Example(
        'zero_bubble', num_ranks=2, stages_per_rank=2, num_microbatches=4,
        makespan=25, bubble=1, span_bubble=1, peaks=[4, 4],
        rows=[
            '0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 '
            '0W2 0I3 0W3',
            '1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 '
            '1I3 1W2 1W3',
        ]),
    'InterleavedZeroBubble p=4 m=8 v=2': Example(
        'zero_bubble', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=51, bubble=3, span_bubble=3, peaks=[8, 8, 8, 8],
        rows=[
            '0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4I0 4W0 0F4 4I1 4W1 0F5 4I2 4W2 0F6 4I3 4W3 0F7 0I0 '
            '0W0 4F4 0I1 0W1 4F5 0I2 0W2 4F6 0I3 0W3 4F7 4I4 4W4 4I5 4W5 4I6 4W6 4I7 4W7 0I4 0W4 '
            '0I5 0W5 0I6 0W6 0I7 0W7',
            '1F0 1F1 1F2 1F3 5F0 5F1 5F2 5I0 5F3 5I1 5W0 1F4 5I2 5W1 1F5 5I3 5W2 1F6 1I0 5W3 1F7 '
            '1I1 1W0 5F4 1I2 1W1 5F5 1I3 1W2 5F6 5I4 1W3 5F7 5I5 5W4 5I6 5W5 5I7 5W6 1I4 5W7 1I5 '
            '1W4 1I6 1W5 1I7 1W6 1W7',
            '2F0 2F1 2F2 2F3 6F0 6F1 6I0 6F2 6I1 6F3 6I2 6W0 2F4 6I3 6W1 2F5 2I0 6W2 2F6 2I1 6W3 '
            '2F7 2I2 2W0 6F4 2I3 2W1 6F5 6I4 2W2 6F6 6I5 2W3 6F7 6I6 6W4 6I7 6W5 2I4 6W6 2I5 6W7 '
            '2I6 2W4 2I7 2W5 2W6 2W7',
            '3F0 3F1 3F2 3F3 7F0 7I0 7F1 7I1 7F2 7I2 7F3 7I3 7W0 3F4 3I0 7W1 3F5 3I1 7W2 3F6 3I2 '
            '7W3 3F7 3I3 3W0 7F4 7I4 3W1 7F5 7I5 3W2 7F6 7I6 3W3 7F7 7I7 7W4 3I4 7W5 3I5 7W6 3I6 '
            '7W7 3I7 3W4 3W5 3W6 3W7',
        ]),
    'ZBV p=2 m=4': Example(
        'v_schedule', num_ranks=2, stages_per_rank=2, num_microbatches=4,
        makespan=25, bubble=1, span_bubble=0, peaks=[4, 4],
        rows=[
            '0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 '
            '0W2 0I3 0W3',
            '1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 '
            '1W2 2W3 1W3',
        ]),
    'ZBV p=4 m=8': Example(
        'v_schedule', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=51, bubble=3, span_bubble=0, peaks=[8, 8, 8, 8],
        rows=[
            '0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 '
            '0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 '
            '0I5 0W5 0I6 0W6 0I7 0W7',
            '1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 '
            '6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4 '
            '1I6 1W5 1I7 1W6 6W7 1W7',
            '2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 '
            '2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4 '
            '2I7 2W5 5W6 5W7 2W6 2W7',
            '3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 '
            '4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 '
            '4W5 4W6 4W7 3W5 3W6 3W7',
        ]),
    'V-Half p=4 m=8': Example(
        'v_half', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=53, bubble=5, span_bubble=5, peaks=[6, 6, 6, 6],
        rows=[
            '0F0 0F1 0F2 0F3 0F4 7F0 7I0 7W0 7F1 7I1 7W1 7F2 0I0 7I2 7W2 7F3 0W0 0F5 0I1 7I3 7W3 '
            '7F4 0W1 0F6 0I2 7I4 7W4 7F5 0W2 0F7 0I3 7I5 7W5 7F6 7I6 7W6 0I4 0W3 0W4 7F7 7I7 0I5 '
            '7W7 0I6 0W5 0W6 0I7 0W7',
            '1F0 1F1 1F2 1F3 6F0 6F1 6I0 6W0 6F2 6I1 6W1 1I0 1W0 1F4 6F3 6I2 6W2 1I1 1W1 1F5 6F4 '
            '6I3 6W3 1I2 1W2 1F6 6F5 6I4 6W4 1I3 1F7 1W3 6F6 6I5 6W5 1I4 6I6 6W6 6F7 1W4 1I5 6I7 '
            '1I6 6W7 1W5 1W6 1I7 1W7',
            '2F0 2F1 2F2 5F0 5F1 5F2 5I0 5W0 2F3 5I1 2I0 5W1 2W0 5F3 2F4 2I1 5I2 5W2 5F4 2W1 2F5 '
            '2I2 5I3 5W3 5F5 2W2 2F6 2I3 5I4 5W4 5F6 2W3 2F7 2I4 5I5 5W5 5F7 5I6 2I5 5W6 2I6 5I7 '
            '5W7 2W4 2I7 2W5 2W6 2W7',
            '3F0 4F0 3F1 4F1 3F2 4F2 4I0 4W0 3I0 3W0 3F3 4F3 4I1 4W1 3I1 3W1 3F4 4F4 4I2 4W2 3I2 '
            '3W2 3F5 4F5 4I3 4W3 3I3 3F6 3W3 4F6 4I4 3I4 4W4 3F7 3W4 4F7 4I5 3I5 4I6 3I6 4W5 4W6 '
            '4I7 3I7 4W7 3W5 3W6 3W7',
        ]),
    'V-Min p=4 m=8': Example(
        'v_min', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=59, bubble=11, span_bubble=11, peaks=[4, 4, 4, 4],
        rows=[
            '0F0 0F1 0F2 7F0 7I0 7W0 7F1 7I1 7W1 0I0 0W0 0F3 7F2 7I2 0I1 7W2 0W1 0F4 7F3 7I3 0I2 '
            '7W3 0W2 0F5 7F4 7I4 0I3 7W4 0W3 0F6 7F5 7I5 0I4 7W5 0W4 0F7 7F6 7I6 0I5 7W6 0W5 7F7 '
            '7I7 0I6 7W7 0W6 0I7 0W7',
            '1F0 1F1 6F0 6F1 6I0 6W0 1F2 1I0 6I1 6W1 1W0 6F2 1F3 1I1 6I2 6W2 1W1 6F3 1F4 1I2 6I3 '
            '6W3 1W2 6F4 1F5 1I3 6I4 6W4 1W3 6F5 1F6 1I4 6I5 6W5 1W4 6F6 1F7 1I5 6I6 6W6 1W5 6F7 '
            '1I6 6I7 6W7 1W6 1I7 1W7',
            '2F0 2F1 5F0 5F1 5I0 5W0 2F2 2I0 2W0 5I1 5F2 5W1 2I1 2F3 2W1 5I2 5F3 5W2 2I2 2F4 2W2 '
            '5I3 5F4 5W3 2I3 2F5 2W3 5I4 5F5 5W4 2I4 2F6 2W4 5I5 5F6 5W5 2I5 2F7 2W5 5I6 5F7 5W6 '
            '2I6 2W6 5I7 5W7 2I7 2W7',
            '3F0 4F0 3F1 4F1 4I0 3I0 4W0 3W0 3F2 4F2 4I1 3I1 4W1 3W1 3F3 4F3 4I2 3I2 4W2 3W2 3F4 '
            '4F4 4I3 3I3 4W3 3W3 3F5 4F5 4I4 3I4 4W4 3W4 3F6 4F6 4I5 3I5 4W5 3W5 3F7 4F7 4I6 3I6 '
            '4W6 3W6 4I7 3I7 4W7 3W7',
        ]),
    'DualPipeV p=2 m=4': Example(
        'dualpipe_v', num_ranks=2, stages_per_rank=2, num_microbatches=4,
        makespan=26, bubble=2, span_bubble=2, peaks=[5, 5],
        rows=[
            '0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3',
            '1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0) (1F3;2B1) (2F3;1B1) 2B2 1B2 2I3 1I3 2W3 1W3',
        ]),
    'DualPipeV p=4 m=8': Example(
        'dualpipe_v', num_ranks=4, stages_per_rank=2, num_microbatches=8,
        makespan=54, bubble=6, span_bubble=6, peaks=[9, 9, 9, 9],
        rows=[
            '0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 (0F7;7B3) '
            '(7F4;0B0) 7B4 (7F5;0B1) 7B5 (7F6;0B2) 7B6 (7F7;0B3) 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 '
            '0W7',
            '1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 (1F6;6B2) (6F4;1B0) '
            '(1F7;6B3) (6F5;1B1) 6B4 (6F6;1B2) 6B5 (6F7;1B3) 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 '
            '1W7',
            '2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 (2F5;5B1) (5F4;2B0) (2F6;5B2) (5F5;2B1) '
            '(2F7;5B3) (5F6;2B2) 5B4 (5F7;2B3) 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7',
            '3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 (4F4;3B0) (3F5;4B1) (4F5;3B1) (3F6;4B2) '
            '(4F6;3B2) (3F7;4B3) (4F7;3B3) 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7',
        ]),
}


# The reference replays DualPipeV's overlapped pairs as composites that start when both halves are
# ready; pp-core runs the halves in sequence, each as soon as it is ready, so the forward of a pair
# may start before the backward's input arrives: same order, shorter makespan (the reference's
# "no overlap" figures are 26/2 and 54/6).
FLATTENED_FIGURES = {"DualPipeV p=2 m=4": (25, 1, 1), "DualPipeV p=4 m=8": (51, 3, 3)}


@pytest.fixture(scope="module")
def plugins():
    return plugins_with(*(f"pp_schedules.{module}" for module in MODULES))


def flat(row: str) -> str:
    """``"(0F3;3B1)"`` -> ``"0F3 3B1"``: an overlapped pair as its two halves, forward first."""
    return row.replace("(", "").replace(")", "").replace(";", " ")


@pytest.mark.parametrize("title", list(EXAMPLES))
def test_reference_example_order_and_figures(plugins, title):
    ex = EXAMPLES[title]
    schedule = build_schedule(ex.schedule, num_ranks=ex.num_ranks,
                              num_microbatches=ex.num_microbatches,
                              stages_per_rank=ex.stages_per_rank, plugins=plugins)
    assert schedule.rows() == [flat(row) for row in ex.rows]
    sim = simulate(schedule)
    figures = FLATTENED_FIGURES.get(title, (ex.makespan, ex.bubble, ex.span_bubble))
    assert (sim.makespan, sim.bubble, sim.span_bubble) == figures
    assert sim.peak_activations == ex.peaks
