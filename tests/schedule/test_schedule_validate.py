"""validate_schedule and build_schedule: every rule of docs/schedules.md "Validation", with the
messages."""

from __future__ import annotations

import pytest
from tests.cases.calls import count_calls

from pp_core import Action, B, F, ScheduleDef, ScheduleError, hookimpl
from pp_core.plugin_manager import load_plugins
from pp_core.schedule.build import build_schedule
from pp_core.schedule.ir import SEND_F, Schedule, parse_action
from pp_core.schedule.validate import validate_schedule
from tests.fixtures.generators import interleaved_zero_bubble
from tests.fixtures.reference_examples import SUPPORTED, make_schedule


def sched(rows: list[str], stage_ranks=None, num_microbatches=None) -> Schedule:
    actions = [[None if c == "." else parse_action(c) for c in row.split()] for row in rows]
    if stage_ranks is None:
        found = {a.stage: r for r, row in enumerate(actions) for a in row if a}
        stage_ranks = tuple(found[s] for s in range(len(found)))
    if num_microbatches is None:
        num_microbatches = 1 + max(a.microbatch for row in actions for a in row if a)
    return Schedule(actions, tuple(stage_ranks), num_microbatches, name="t")


ONE_F_ONE_B = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


@pytest.mark.parametrize("example", SUPPORTED, ids=[e["title"] for e in SUPPORTED])
def test_reference_examples_are_valid(example):
    validate_schedule(make_schedule(example))


def test_idle_cells_are_allowed():
    validate_schedule(sched(["0F0 0F1 . 0B0 0B1", ". 1F0 1B0 1F1 1B1"]))


def test_stage_on_two_ranks_is_rejected():
    s = sched(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 0F2"], stage_ranks=(0, 1), num_microbatches=2)
    with pytest.raises(ScheduleError, match=r"microbatch 2, but the schedule has 2 microbatches"):
        validate_schedule(s)
    s = sched(["0F0 0B0", "1F0 1B0 0F1 0B1"], stage_ranks=(0, 1), num_microbatches=2)
    with pytest.raises(ScheduleError, match=r"rank 1 step 2: 0F1: stage 0 is placed on rank 0"):
        validate_schedule(s)


def test_stage_out_of_range():
    s = sched(["0F0 0B0", "1F0 1B0 2F0"], stage_ranks=(0, 1), num_microbatches=1)
    with pytest.raises(ScheduleError, match=r"names stage 2, but the schedule has 2 stages"):
        validate_schedule(s)


def test_incomplete_lists_each_missing_pair():
    s = sched(["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"])
    with pytest.raises(ScheduleError, match=r"incomplete.*\n.*stage 0 microbatch 1 \(rank 0\): "
                                            r"the backward is missing \(add 0B1, or 0I1 then "
                                            r"0W1\)"):
        validate_schedule(s)
    s = sched(["0F0 0F1 0B0 0B1", "1F0 1I0 1F1 1B1"])
    with pytest.raises(ScheduleError, match=r"1W0 is missing \(every I needs a later W"):
        validate_schedule(s)


def test_duplicates_are_rejected():
    with pytest.raises(ScheduleError, match=r"step 1: 0F0 is a second forward .* step 0 \(0F0\)"):
        validate_schedule(sched(["0F0 0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))
    with pytest.raises(ScheduleError, match=r"0I0 is a second backward"):
        validate_schedule(sched(["0F0 0F1 0B0 0I0 0B1", "1F0 1B0 1F1 1B1"]))
    with pytest.raises(ScheduleError, match=r"0W0 is a second W"):
        validate_schedule(sched(["0F0 0F1 0I0 0W0 0W0 0B1", "1F0 1B0 1F1 1B1"]))


def test_local_order_w_before_i_and_b_before_f():
    with pytest.raises(ScheduleError, match=r"rank 1 step 1: 1W0 comes before 1I0; W"):
        validate_schedule(sched(["0F0 0F1 0B0 0B1", "1F0 1W0 1I0 1F1 1B1"]))
    with pytest.raises(ScheduleError, match=r"rank 1 step 0: 1B0 comes before its forward 1F0 "
                                            r"at step 1 \(1F0\)"):
        validate_schedule(sched(["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"]))
    with pytest.raises(ScheduleError, match=r"0W0 follows the full backward 0B0"):
        validate_schedule(sched(["0F0 0F1 0B0 0W0 0B1", "1F0 1B0 1F1 1B1"]))


def test_local_order_error_prints_grid_with_marked_step():
    with pytest.raises(ScheduleError) as err:
        validate_schedule(sched(["0F0 0F1 0B0 0B1", "1F0 1W0 1I0 1F1 1B1"]))
    grid = str(err.value).split("grid (")[1].splitlines()
    assert grid[1].split() == ["step", "0", "1", "2", "3", "4"]
    assert grid[3].split() == ["rank", "1", "1F0", "[1W0]", "1I0", "1F1", "1B1"]


def test_comm_action_in_compute_only_schedule():
    s = sched(ONE_F_ONE_B)
    s.actions[0].insert(1, Action(0, SEND_F, 0))
    with pytest.raises(ScheduleError, match=r"rank 0 step 1: 0SEND_F0 is a communication action"):
        validate_schedule(s)


def test_non_action_items_are_rejected():
    s = sched(ONE_F_ONE_B)
    s.actions[0][1] = "0F1"
    with pytest.raises(ScheduleError, match=r"rank 0 step 1: expected an Action"):
        validate_schedule(s)


def test_deadlock_names_wait_chain_and_grid():
    s = sched(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"])  # rank 0 waits 1B0 behind 1F1, needs 0F1
    with pytest.raises(ScheduleError) as err:
        validate_schedule(s)
    msg = str(err.value)
    assert msg.startswith("schedule 't' deadlocks at rank 0 step 1 (0B0)")
    assert ("rank 0 step 1: 0B0 waits for 1B0 at rank 1 step 2,\n"
            "  which comes after 1F1 at rank 1 step 1,\n"
            "  which waits for 0F1 at rank 0 step 2,\n"
            "  which comes after 0B0 at rank 0 step 1,\n"
            "  which closes the cycle (back at rank 0 step 1).") in msg
    assert "[0B0]" in msg and "[1F1]" in msg
    assert not isinstance(err.value, AssertionError)


def test_deadlock_three_ranks_direct_chain():
    # rank 2 wants 2F1 first; it needs 1F1, which rank 1 runs only after 1B0, which needs 2B0.
    s = sched(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1", "2F1 2F0 2B0 2B1"])
    with pytest.raises(ScheduleError, match=r"deadlocks at rank 1 step 1 \(1B0\): .*\n"
                                            r"  rank 1 step 1: 1B0 waits for 2B0 at rank 2 "
                                            r"step 2,\n  which comes after 2F1 at rank 2 step 0,"
                                            r"\n  which waits for 1F1 at rank 1 step 2,\n"
                                            r"  which comes after 1B0 at rank 1 step 1,\n"
                                            r"  which closes the cycle \(back at rank 1 step 1\)"):
        validate_schedule(s)


def test_backward_waits_for_input_grad_not_weight_grad():
    # 1W0 comes last on rank 1; 0B0 only needs 1I0, so this is valid.
    validate_schedule(sched(["0F0 0F1 0B0 0B1", "1F0 1I0 1F1 1I1 1W1 1W0"]))


def test_same_rank_dependency_cycle_on_v_placement():
    s = sched(["0F0 3F0 3B0 0B0", "2F0 1F0 1B0 2B0"], stage_ranks=(0, 1, 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1 step 0: 2F0 waits for 1F0 at rank 1 step 1,"
                                            r"\n  which comes after 2F0 at rank 1 step 0"):
        validate_schedule(s)


def test_ranks_without_stages_and_bad_shapes():
    with pytest.raises(ScheduleError, match=r"rank\(s\) 2 hold no stage"):
        validate_schedule(Schedule([[], [], []], (0, 1), 1))
    with pytest.raises(ScheduleError, match=r"num_microbatches must be an int >= 1"):
        validate_schedule(Schedule([[]], (0,), 0))
    with pytest.raises(ScheduleError, match=r"stage 1 is placed on rank 5"):
        validate_schedule(Schedule([[], []], (0, 5), 1))


def test_interleaved_zero_bubble_generator_matches_reference_example():
    example = next(e for e in SUPPORTED if e["title"] == "InterleavedZeroBubble p=4 m=8 v=2")
    assert interleaved_zero_bubble(4, 8, 2).rows() == example["rows"]


def test_validation_is_linear():
    """Four times the microbatches cost about four times the work, counted in function calls
    (pp=64, v=2, m=1024 - 393k actions - validates in ~0.3 s; benchmarks report times)."""
    small = count_calls(validate_schedule, interleaved_zero_bubble(8, 32, 2))
    large = count_calls(validate_schedule, interleaved_zero_bubble(8, 128, 2))
    assert 3.0 < large / small < 5.0, (small, large)


# ----------------------------------------------------------------------------- build_schedule


def _gpipe(num_stages, num_microbatches, num_ranks):
    mbs = range(num_microbatches)
    return [[Action(r, F, k) for k in mbs] + [Action(r, B, k) for k in mbs]
            for r in range(num_ranks)]


def _looped(num_stages, num_microbatches, num_ranks):
    rows = []
    for r in range(num_ranks):
        stages = list(range(r, num_stages, num_ranks))
        row = [Action(s, F, k) for s in stages for k in range(num_microbatches)]
        row += [Action(s, B, k) for s in reversed(stages) for k in range(num_microbatches)]
        rows.append(row)
    return rows


def _too_few_rows(num_stages, num_microbatches, num_ranks):
    return _gpipe(num_stages, num_microbatches, num_ranks)[:-1]


def _needs_even(num_stages, num_microbatches, num_ranks):
    if num_microbatches % 2:
        raise ScheduleError(f"needs an even num_microbatches, got {num_microbatches}")
    return _gpipe(num_stages, num_microbatches, num_ranks)


class _Plugin:
    @hookimpl
    def pp_register_schedules(self, register):
        register("gpipe", ScheduleDef(_gpipe, aliases=("ScheduleGPipe",)))
        register("looped", ScheduleDef(_looped, stages_per_rank=2, variable_stages_per_rank=True))
        register("broken", ScheduleDef(_too_few_rows))
        register("even", ScheduleDef(_needs_even))
        register("bare", _gpipe)


@pytest.fixture
def plugins():
    return load_plugins(entry_points=False, plugins=[("test_schedules", _Plugin())])


def test_build_by_name_and_alias(plugins):
    s = build_schedule("schedulegpipe", num_ranks=2, num_microbatches=2, plugins=plugins)
    assert s.name == "gpipe" and s.stage_ranks == (0, 1) and s.num_microbatches == 2
    assert s.rows() == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]
    assert build_schedule("bare", num_ranks=1, num_microbatches=1, plugins=plugins).num_stages == 1


def test_build_stages_per_rank(plugins):
    s = build_schedule("looped", num_ranks=2, num_microbatches=2, plugins=plugins)
    assert s.stage_ranks == (0, 1, 0, 1)
    s = build_schedule("looped", num_ranks=2, num_microbatches=2, stages_per_rank=3,
                       plugins=plugins)
    assert s.num_stages == 6
    with pytest.raises(ScheduleError, match=r"'gpipe' runs exactly 1 stage\(s\) per rank, got "
                                            r"stages_per_rank=2; set stages_per_rank=1"):
        build_schedule("gpipe", num_ranks=2, num_microbatches=2, stages_per_rank=2,
                       plugins=plugins)


def test_build_errors(plugins):
    with pytest.raises(ScheduleError, match=r"unknown schedule 'gpip'; did you mean 'gpipe'\?.*"
                                            r"gpipe \(from test_schedules\)"):
        build_schedule("gpip", num_ranks=2, num_microbatches=2, plugins=plugins)
    with pytest.raises(ScheduleError, match=r"num_ranks must be an integer >= 1, got 0"):
        build_schedule("gpipe", num_ranks=0, num_microbatches=2, plugins=plugins)
    with pytest.raises(ScheduleError, match=r"num_microbatches must be an integer >= 1, got 2.0"):
        build_schedule("gpipe", num_ranks=2, num_microbatches=2.0, plugins=plugins)
    with pytest.raises(ScheduleError, match=r"generator returned 1 rank lists for num_ranks=2"):
        build_schedule("broken", num_ranks=2, num_microbatches=2, plugins=plugins)
    with pytest.raises(ScheduleError, match=r"needs an even num_microbatches, got 3"):
        build_schedule("even", num_ranks=2, num_microbatches=3, plugins=plugins)
    with pytest.raises(ScheduleError, match=r"needs a schedule name"):
        build_schedule(num_ranks=2, num_microbatches=3, plugins=plugins)


def test_build_from_csv(tmp_path, plugins):
    path = tmp_path / "order.csv"
    path.write_bytes(b"0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n")
    s = build_schedule("ignored-name", num_ranks=2, num_microbatches=2, csv_path=path,
                       plugins=plugins)
    assert s.name == "order" and s.stage_ranks == (0, 1)
    assert build_schedule(num_ranks=2, num_microbatches=2, csv_path=str(path),
                          stages_per_rank=1).num_stages == 2
    with pytest.raises(ScheduleError, match=r"has 2 rows \(one per rank\), but the pipeline has "
                                            r"num_ranks=4"):
        build_schedule(num_ranks=4, num_microbatches=2, csv_path=path)
    with pytest.raises(ScheduleError, match=r"schedules 2 microbatches \(0...1\), but "
                                            r"num_microbatches=8"):
        build_schedule(num_ranks=2, num_microbatches=8, csv_path=path)
    with pytest.raises(ScheduleError, match=r"has 2 stages on 2 ranks, but stages_per_rank=2"):
        build_schedule(num_ranks=2, num_microbatches=2, csv_path=path, stages_per_rank=2)
