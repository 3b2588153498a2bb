"""The one walk (pp_core.schedule.replay): the action code, the stage graph, and what validation
remembers about a schedule it checked."""

import dataclasses

import pytest

from pp_core.errors import ScheduleError
from pp_core.schedule import Action, B, F, I, Schedule, W, parse_action
from pp_core.schedule.build import build_schedule
from pp_core.schedule.csv_io import format_csv, parse_csv
from pp_core.schedule.ir import RECV_B, RECV_F, SEND_B, SEND_F
from pp_core.schedule.lower import lower
from pp_core.schedule.replay import (
    FORWARD,
    GRADIENT,
    KIND_CODE,
    Dependencies,
    chain,
    decode,
    encode,
    unpack,
)
from pp_core.schedule.simulate import simulate
from pp_core.schedule.validate import encode_validated, validate_schedule, validated


def test_every_kind_packs_and_unpacks():
    for kind in (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B):
        action = Action(3, kind, 5)
        code = encode(action, 7)
        assert decode(code, 7) == action
        assert unpack(code) == (3 * 7 + 5, KIND_CODE[kind])


def _diamond(actions=None) -> Schedule:
    """Stage 0 feeds stages 1 and 2, which both feed stage 3; a stage per rank, GPipe order."""
    rows = actions or [[Action(r, F, 0), Action(r, B, 0)] for r in range(4)]
    return Schedule(rows, (0, 1, 2, 3), 1, "diamond", edges=((0, 1), (0, 2), (1, 3), (2, 3)))


def test_a_stage_graph_that_is_not_a_chain_is_data():
    schedule = _diamond()
    validate_schedule(schedule)
    rule = Dependencies(schedule)
    assert rule.inputs(3, KIND_CODE[F]) == ((1, FORWARD), (2, FORWARD))
    assert rule.inputs(0, KIND_CODE[B]) == ((1, GRADIENT), (2, GRADIENT))
    # F 0-1, F1 and F2 1-2, F3 2-3, B3 3-5, B1 and B2 5-7, B0 7-9 (a chain of 4 takes 12)
    result = simulate(schedule)
    assert result.makespan == 9
    assert [str(a) for a, _, _ in result.timeline[0]] == ["0F0", "0B0"]
    assert simulate(dataclasses.replace(schedule, edges=None)).makespan == 12


def test_the_chain_written_out_is_the_default():
    schedule = build_schedule("1f1b", num_ranks=3, num_microbatches=4)
    written = dataclasses.replace(schedule, edges=chain(3))
    assert simulate(written).to_dict(timeline=True) == simulate(schedule).to_dict(timeline=True)
    assert lower(written).rows() == lower(schedule).rows()
    assert format_csv(written) == format_csv(schedule)


@pytest.mark.parametrize("edges, message", [
    (((0, 4),), "schedule 'diamond': edge (0, 4) must be a pair (from stage, to stage) of two "
                "different stages in 0..3"),
    (((1, 1),), "schedule 'diamond': edge (1, 1) must be a pair (from stage, to stage) of two "
                "different stages in 0..3"),
    (((0, 1), (1, 2), (2, 1), (2, 3)), "schedule 'diamond': edges form a cycle through stages "
                                       "[1, 2, 3]; a stage can only read stages whose forwards "
                                       "do not need its own"),
])
def test_bad_edges_are_named(edges, message):
    with pytest.raises(ScheduleError) as caught:
        validate_schedule(dataclasses.replace(_diamond(), edges=edges))
    assert str(caught.value) == message


def test_what_the_ir_cannot_say_is_refused():
    with pytest.raises(ScheduleError) as caught:
        lower(_diamond())
    assert str(caught.value) == (
        "stage 0 sends to stages [1, 2] on other ranks; a lowered program's SEND_F names only "
        "its own stage, so lowering takes one such stage per direction (the IR's SEND would "
        "have to name its peer)")
    with pytest.raises(ScheduleError) as caught:
        format_csv(_diamond())
    assert str(caught.value) == (
        "schedule 'diamond' has stage edges [(0, 1), (0, 2), (1, 3), (2, 3)]; a CSV schedule "
        "(torch's) is the chain of its stages, so it cannot say them: keep the Schedule in "
        "Python")


def test_a_schedule_changed_after_validation_is_validated_again():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    codes = encode_validated(schedule)
    assert validated(schedule, deadlock_free=True).codes is codes
    # an equal action in place of another changes nothing
    schedule.actions[0][0] = parse_action(str(schedule.actions[0][0]))
    assert encode_validated(schedule) is codes
    # a backward before its forward, written into the validated rows in place
    row = schedule.actions[1]
    row[0], row[1] = row[1], row[0]
    assert validated(schedule) is None
    with pytest.raises(ScheduleError) as caught:
        validate_schedule(schedule)
    assert str(caught.value) == (
        "schedule '1f1b', rank 1 step 0: 1B0 comes before its forward 1F0 at step 1 (1F0); F must "
        "come before I/B\ngrid (steps 0..3 shown; blocked/bad actions in [brackets]):\n"
        "step     0     1     2     3\nrank 0  0F0   0F1   0B0   0B1\nrank 1 [1B0]  1F0   1F1   1B1")
    with pytest.raises(ScheduleError) as caught:
        lower(schedule)
    assert str(caught.value) == (
        "schedule '1f1b' cannot run: its dependencies form a cycle (rank 0 waits at 0B0; rank 1 "
        "waits at 1B0); run validate_schedule() for the rank x step grid, and reorder the actions "
        "so each forward follows the previous stage's forward and each backward the next stage's")
    row[0], row[1] = row[1], row[0]
    validate_schedule(schedule)
    schedule.stage_ranks = (1, 0)
    assert validated(schedule) is None


def test_idle_steps_take_their_turn_in_lowering_after_validation():
    schedule = parse_csv("0F0,0F1,,0B0,0B1\r\n,1F0,1B0,1F1,1B1\r\n")  # validated: remembered
    assert validated(schedule).idle
    fresh = dataclasses.replace(schedule)  # the same rows, never validated
    assert validated(fresh) is None
    assert lower(schedule).rows() == lower(fresh).rows()
