"""Receive-buffer sizing: interval colouring of lowered receive lifetimes (pure Python, fast)."""

import itertools
import json
import random

import pytest

from pp_core.errors import ScheduleError
from pp_core.schedule import RECV_B, RECV_F, build_schedule, read_csv
from pp_core.schedule.buffer_plan import (
    BufferClass,
    colour_intervals,
    max_live,
    plan_program,
    plan_recv_buffers,
    recv_buffer_report,
)
from pp_core.schedule.lower import lower

# (name, num_ranks, num_microbatches) for every built-in schedule, sizes each one admits.
SCHEDULES = [
    ("1f1b", 4, 8), ("gpipe", 4, 8), ("interleaved_1f1b", 4, 8), ("looped_bfs", 4, 8),
    ("dfs", 4, 8), ("zero_bubble", 4, 8), ("zb_h2", 4, 8), ("v_schedule", 4, 8),
    ("dualpipe_v", 4, 8),
]

# A hand-written compute-only CSV (torch format): p=2, v=2 loop placement, BFS forwards,
# I/W-split backwards on stages 0, 2, 3 and a full backward on stage 1.
CUSTOM_CSV = (
    "0F0,0F1,0F2,0F3,2F0,2F1,2F2,2F3,2I0,2I1,2I2,2I3,0I0,0I1,0I2,0I3,"
    "2W0,2W1,2W2,2W3,0W0,0W1,0W2,0W3\r\n"
    "1F0,1F1,1F2,1F3,3F0,3F1,3F2,3F3,3I0,3W0,3I1,3W1,3I2,3W2,3I3,3W3,1B0,1B1,1B2,1B3\r\n"
)


def _assert_valid_assignment(program, plan, lifetime_end="consumed"):
    """No two receives of one class whose intervals overlap share a buffer set."""
    by_class = {}
    for lifetime in program.recv_lifetimes:
        action = lifetime.action
        end = getattr(lifetime, lifetime_end)
        by_class.setdefault((action.stage, action.kind), []).append(
            (lifetime.posted, end, plan.slot(action)))
    for (stage, kind), entries in by_class.items():
        class_plan = plan.classes[BufferClass(stage, kind)]
        for (s1, e1, c1), (s2, e2, c2) in itertools.combinations(entries, 2):
            if c1 == c2:
                assert e1 < s2 or e2 < s1, f"{stage}{kind} slot {c1} shared while live"
        assert all(0 <= c < class_plan.sets for _, _, c in entries)
        assert class_plan.lower_bound == max_live((s, e) for s, e, _ in entries)


def test_max_live_counts_closed_intervals():
    assert max_live([]) == 0
    assert max_live([(0, 1), (1, 2)]) == 2  # closed: they share index 1
    assert max_live([(0, 1), (2, 3)]) == 1
    assert max_live([(0, 9), (1, 2), (3, 4), (5, 6)]) == 2


def test_colour_intervals_is_optimal_and_proper_on_random_inputs():
    rng = random.Random(0)
    for _ in range(200):
        intervals = []
        for _ in range(rng.randint(1, 30)):
            start = rng.randint(0, 50)
            intervals.append((start, start + rng.randint(0, 15)))
        slack = rng.randint(0, 2)
        colours, palette = colour_intervals(intervals, slack)
        assert palette == max_live(intervals) + slack
        assert all(0 <= c < palette for c in colours)
        for (a, b), (c, d), x, y in ((intervals[i], intervals[j], colours[i], colours[j])
                                     for i, j in itertools.combinations(range(len(intervals)), 2)):
            if x == y:
                assert b < c or d < a


def test_colour_intervals_prefers_the_least_recently_freed_set():
    # Back-to-back receives rotate through all sets when slack allows, like NeMo's ring.
    colours, palette = colour_intervals([(0, 1), (2, 3), (4, 5), (6, 7)], slack=2)
    assert palette == 3
    assert colours == [0, 1, 2, 0]


def test_colour_intervals_rejects_negative_slack():
    with pytest.raises(ScheduleError, match="slack"):
        colour_intervals([(0, 1)], slack=-1)


@pytest.mark.parametrize("name,num_ranks,num_microbatches", SCHEDULES)
def test_every_builtin_schedule_gets_a_proper_minimal_assignment(name, num_ranks, num_microbatches):
    program = lower(build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches))
    for rank in range(program.num_ranks):
        rank_program = program.rank(rank)
        for end in ("consumed", "released"):
            plan = plan_recv_buffers(rank_program, slack=2, lifetime_end=end)
            _assert_valid_assignment(rank_program, plan, end)
            for class_plan in plan.classes.values():
                assert class_plan.default_sets == num_microbatches
                assert 1 <= class_plan.lower_bound <= num_microbatches
        copy = plan_recv_buffers(rank_program, 0)
        in_place = plan_recv_buffers(rank_program, 0, "released")
        for buffer_class, class_plan in copy.classes.items():
            assert class_plan.lower_bound <= in_place.classes[buffer_class].lower_bound


@pytest.mark.parametrize("num_ranks,num_microbatches", [(2, 4), (4, 4), (4, 16), (8, 32), (3, 7)])
@pytest.mark.parametrize("slack", [0, 2])
def test_1f1b_needs_no_more_than_nemo_ring(num_ranks, num_microbatches, slack):
    program = lower(build_schedule("1f1b", num_ranks=num_ranks, num_microbatches=num_microbatches))
    for plan in plan_program(program, slack):
        for buffer_class, class_plan in plan.classes.items():
            ring = program.num_stages - buffer_class.stage + slack
            assert class_plan.sets <= ring, (buffer_class, class_plan.sets, ring)
            assert class_plan.lower_bound == 1  # copy-out: one set per direction suffices
    # Used in place until the backward releases it (no copy-out), a forward receive needs one set
    # more than the activations in flight: the next receive is posted before the oldest backward
    # frees its buffer. That is why NeMo's in-place ring only works with slack >= 1.
    for plan in plan_program(program, 0, "released"):
        for buffer_class, class_plan in plan.classes.items():
            if buffer_class.kind is RECV_F:
                in_flight = min(program.num_stages - buffer_class.stage, num_microbatches)
                assert class_plan.lower_bound <= in_flight + 1


def test_csv_schedule_is_planned_like_a_builtin(tmp_path):
    path = tmp_path / "custom.csv"
    path.write_text(CUSTOM_CSV, newline="")
    schedule = build_schedule(num_ranks=2, num_microbatches=4, csv_path=path)
    program = lower(schedule)
    plans = plan_program(program, slack=1)
    for rank, plan in enumerate(plans):
        _assert_valid_assignment(program.rank(rank), plan)
    # BFS forwards: stage 2's four receives all arrive before the first is consumed.
    assert plans[0].classes[BufferClass(2, RECV_F)].lower_bound >= 1
    assert {c for p in plans for c in p.classes} == {
        BufferClass(1, RECV_F), BufferClass(2, RECV_F), BufferClass(3, RECV_F),
        BufferClass(0, RECV_B), BufferClass(1, RECV_B), BufferClass(2, RECV_B)}
    assert read_csv(path).num_microbatches == 4


def test_plan_slot_names_the_missing_receive():
    program = lower(build_schedule("1f1b", num_ranks=2, num_microbatches=2))
    plan = plan_recv_buffers(program.rank(0))
    from pp_core.schedule.ir import Action

    with pytest.raises(ScheduleError, match=r"rank 0's program has no receive 0RECV_F0"):
        plan.slot(Action(0, RECV_F, 0))


@pytest.mark.parametrize("slack", [-1, 1.5, True])
def test_plan_rejects_bad_slack(slack):
    program = lower(build_schedule("1f1b", num_ranks=2, num_microbatches=2))
    with pytest.raises(ScheduleError, match="pp_recv_buffer_pool_slack"):
        plan_recv_buffers(program.rank(0), slack)


def test_plan_rejects_unknown_lifetime_end():
    program = lower(build_schedule("1f1b", num_ranks=2, num_microbatches=2))
    with pytest.raises(ScheduleError, match="lifetime_end"):
        plan_recv_buffers(program.rank(0), lifetime_end="posted")


def test_report_counts_sets_and_bytes_per_rank_and_class():
    program = lower(build_schedule("1f1b", num_ranks=4, num_microbatches=16))
    report = recv_buffer_report(program, slack=2, bytes_per_set={(1, "F"): 100, (1, "B"): 10})
    json.dumps(report)  # JSON-ready
    rank1 = {(c["stage"], c["direction"]): c for c in report["ranks"][1]["classes"]}
    assert rank1[(1, "F")] == {
        "stage": 1, "direction": "F", "default_sets": 16, "lower_bound": 1, "pool_sets": 3,
        "no_copy_lower_bound": 4, "nemo_ring": 5, "default_bytes": 1600, "pool_bytes": 300}
    assert rank1[(1, "B")]["pool_bytes"] == 30
    assert "default_bytes" not in report["ranks"][2]["classes"][0]  # no size given for stage 2
    assert report["ranks"][0]["classes"] == [
        {"stage": 0, "direction": "B", "default_sets": 16, "lower_bound": 1, "pool_sets": 3,
         "no_copy_lower_bound": 1, "nemo_ring": 6}]
    assert report["total"]["default_sets"] == 6 * 16
    assert report["total"]["pool_sets"] == 6 * 3
    plain = recv_buffer_report(program)
    assert "default_bytes" not in plain["total"]


def test_receives_of_different_classes_never_share():
    program = lower(build_schedule("v_schedule", num_ranks=2, num_microbatches=4))
    plan = plan_recv_buffers(program.rank(1), slack=0)
    kinds = {(c.stage, c.kind) for c in plan.classes}
    assert len(kinds) == len(plan.classes)
    assert all(c.kind in (RECV_F, RECV_B) for c in plan.classes)


def test_schedule_simulate_json_reports_recv_buffers(capsys, tmp_path):
    from pp_core.app.cli import main

    code = main(["schedule", "simulate", "gpipe", "--pp", "4", "--microbatches", "16", "--json",
                 "--pool-slack", "1", "--recv-bytes", "1024"])
    figures = json.loads(capsys.readouterr().out)
    assert code == 0
    program = lower(build_schedule("gpipe", num_ranks=4, num_microbatches=16))
    assert figures["recv_buffers"] == recv_buffer_report(program, 1, 1024)
    last = {c["direction"]: c for c in figures["recv_buffers"]["ranks"][3]["classes"]}
    assert last["F"]["default_bytes"] == 16 * 1024
    assert last["F"]["pool_bytes"] == (last["F"]["lower_bound"] + 1) * 1024
    path = tmp_path / "custom.csv"
    path.write_text(CUSTOM_CSV, newline="")
    assert main(["schedule", "simulate", "--csv", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recv_buffers"]["slack"] == 2
    assert main(["schedule", "simulate", "1f1b", "--pp", "2", "-m", "2", "--pool-slack", "-1"]) == 1
    assert "slack=-1 must be an int >= 0" in capsys.readouterr().err
