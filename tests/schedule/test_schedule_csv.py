"""CSV I/O: torch 2.13's and 2.15's own dumps load, pp-core's files load in torch, round trips, bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from pp_core import ScheduleError
from pp_core.schedule.csv_io import format_csv, parse_csv, read_csv, write_csv
from pp_core.schedule.ir import Schedule, parse_action
from tests.fixtures.reference_examples import SUPPORTED, make_schedule

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# Reference section 1.2: torch 2.13 ScheduleInterleavedZeroBubble p=2 v=2 m=4, compute_only.
TORCH_IZB_CSV = (
    "0F0,0F1,2F0,,2F1,2I0,2W0,0F2,2I1,2W1,0F3,0I0,0W0,2F2,0I1,0W1,2F3,2I2,2W2,2I3,2W3,0I2,0W2,"
    "0I3,0W3\r\n"
    ",1F0,1F1,3F0,3I0,3F1,3I1,3W0,1F2,1I0,3W1,1F3,1I1,1W0,3F2,3I2,1W1,3F3,3I3,3W2,1I2,3W3,1I3,"
    "1W2,1W3\r\n"
)


def example(title: str) -> dict:
    return next(e for e in SUPPORTED if e["title"] == title)


# ----------------------------------------------------------------------------- torch's own files


@pytest.fixture(scope="module")
def torch_pipelining():
    """torch's schedule classes, built on stand-in stages exactly as torch's own visualizer
    (``_schedule_visualizer.get_schedule_ops``) does: a schedule object only reads
    ``num_stages``/``group_size``/``group_rank`` from its stages, and a real PipelineStage
    would need one process per rank."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from unittest import mock

    from torch.distributed.pipelining.stage import PipelineStage

    def make(cls, num_ranks, num_microbatches, stages_per_rank):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = 0, num_ranks, None
        stage.num_stages = num_ranks * stages_per_rank
        return cls([stage] * stages_per_rank, num_microbatches)

    return schedules, make


def test_torch_interleaved_zero_bubble_dump_loads(torch_pipelining, tmp_path):
    schedules, make = torch_pipelining
    sched = make(schedules.ScheduleInterleavedZeroBubble, 2, 4, 2)
    path = tmp_path / "izb.csv"
    sched._dump_csv(str(path), format="compute_only")
    assert path.read_bytes().decode() == TORCH_IZB_CSV  # the reference's copy of torch's dump
    loaded = read_csv(path)
    assert loaded.name == "izb" and loaded.stage_ranks == (0, 1, 0, 1)
    assert loaded.num_microbatches == 4
    assert loaded.actions[0][3] is None and loaded.actions[1][0] is None
    assert loaded.rows() == example("InterleavedZeroBubble p=2 m=4 v=2")["rows"]
    assert format_csv(loaded) == TORCH_IZB_CSV  # byte-identical when written back


@pytest.mark.parametrize("cls,title,stage_ranks", [
    ("ScheduleInterleaved1F1B", "Interleaved1F1B p=4 m=8 v=2", (0, 1, 2, 3, 0, 1, 2, 3)),
    ("ScheduleLoopedBFS", "LoopedBFS p=4 m=8 v=2", (0, 1, 2, 3, 0, 1, 2, 3)),
    ("ScheduleZBVZeroBubble", "ZBV p=4 m=8", (0, 1, 2, 3, 3, 2, 1, 0)),
    ("ScheduleDualPipeV", "DualPipeV p=4 m=8", (0, 1, 2, 3, 3, 2, 1, 0)),
])
def test_torch_dumps_load(torch_pipelining, tmp_path, cls, title, stage_ranks):
    schedules, make = torch_pipelining
    sched = make(getattr(schedules, cls), 4, 8, 2)
    path = tmp_path / "s.csv"
    sched._dump_csv(str(path), format="compute_only")
    if cls == "ScheduleDualPipeV":
        assert "OVERLAP_F_B" in path.read_text()
    loaded = read_csv(path)
    assert loaded.stage_ranks == stage_ranks
    assert loaded.rows() == [" ".join(c.strip("()").replace(";", " ") for c in row.split())
                             for row in example(title)["rows"]]


def test_torch_compute_comms_dump_loads(torch_pipelining, tmp_path):
    """torch's default dump format (with SEND/RECV/UNSHARD/RESHARD/REDUCE_GRAD) loads too."""
    schedules, make = torch_pipelining
    sched = make(schedules.ScheduleInterleavedZeroBubble, 2, 4, 2)
    sched._prepare_schedule_with_comms(sched.pipeline_order)
    path = tmp_path / "comms.csv"
    sched._dump_csv(str(path))  # _PipelineScheduleRuntime's default: compute_comms
    text = path.read_text()
    assert "RECV_F" in text and "UNSHARD" in text and "REDUCE_GRAD" in text
    loaded = read_csv(path)
    assert loaded.rows() == example("InterleavedZeroBubble p=2 m=4 v=2")["rows"]
    with pytest.raises(ScheduleError, match=r"row 0 \(rank 0\), column 0: '0UNSHARD' is a "
                                            r"communication action, but format='compute_only'"):
        read_csv(path, format="compute_only")


@pytest.mark.parametrize("title", ["ZBV p=4 m=8", "InterleavedZeroBubble p=4 m=8 v=2",
                                   "V-Half p=4 m=8"])
def test_torch_loads_pp_core_csv(torch_pipelining, tmp_path, title):
    """torch's _load_csv (validation, placement inference, lowering) accepts pp-core's files."""
    schedules, make = torch_pipelining
    ours = make_schedule(example(title))
    path = tmp_path / "ours.csv"
    write_csv(ours, path)
    runtime = make(schedules._PipelineScheduleRuntime, 4, 8, 2)
    runtime._load_csv(str(path), format="compute_only")
    assert [[str(a) for a in runtime.pipeline_order[r]] for r in range(4)] == \
        [row.split() for row in ours.rows()]
    assert runtime.pipeline_order_with_comms  # torch lowered it without finding a deadlock


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("ex", SUPPORTED, ids=[e["title"] for e in SUPPORTED])
def test_round_trip(tmp_path, ex):
    schedule = make_schedule(ex)
    schedule.actions[-1].insert(0, None)  # idle cells survive too
    path = tmp_path / "s.csv"
    write_csv(schedule, path)
    assert b"\r\n" in path.read_bytes()
    loaded = read_csv(path)
    assert (loaded.actions, loaded.stage_ranks, loaded.num_microbatches) == \
        (schedule.actions, schedule.stage_ranks, schedule.num_microbatches)
    assert read_csv(str(path)).actions == schedule.actions
    assert parse_csv(format_csv(schedule)).actions == schedule.actions


def test_read_text_and_idle_rows():
    s = read_csv("0F0,,0B0\n1F0,1B0\n")
    assert s.actions == [[parse_action("0F0"), None, parse_action("0B0")],
                         [parse_action("1F0"), parse_action("1B0")]]
    assert s.name == "csv"


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("name,message", [
    ("bad_incomplete.csv", r"schedule CSV '.*bad_incomplete.csv': schedule 'bad_incomplete' is "
                           r"incomplete: .*\n  stage 0 microbatch 1 \(rank 0\): the backward is "
                           r"missing"),
    ("bad_deadlock.csv", r"deadlocks at rank 0 step 1 \(0B0\).*\n  rank 0 step 1: 0B0 waits for "
                         r"1B0 at rank 1 step 2"),
    ("bad_w_before_i.csv", r"rank 1 step 1: 1W0 comes before 1I0; W \(weight grads\) must follow"),
    ("bad_stage_two_ranks.csv", r"stage 0 appears in row 0 and in row 1 \(as 0F2\); each stage "
                                r"lives on exactly one rank"),
    ("bad_malformed.csv", r"row 1 \(rank 1\), column 2: cannot parse action '1F1junk': "
                          r"unexpected trailing characters at position 3"),
])
def test_bad_csv_files(name, message):
    with pytest.raises(ScheduleError, match=message):
        read_csv(FIXTURES / name)


@pytest.mark.parametrize("text,message", [
    ("0F0,0B0\n1F0,1B\n", r"column 1: cannot parse action '1B': expected a microbatch number"),
    ("0F0,0B0\n1F0,F0\n", r"column 1: cannot parse action 'F0': it must start with a stage"),
    ("0F0,0B0\n1F0,1X0\n", r"column 1: cannot parse action '1X0': expected an action kind"),
    ("(0F0;1B0;2B0)OVERLAP_F_B,0B0\n", r"holds exactly two actions"),
    ("(0F0,0B0\n", r"cannot parse '\(0F0': a cell starting with '\('"),
    (",\n,\n", r"holds no actions"),
    ("0F0,0B0\n2F0,2B0\n", r"stage\(s\) 1 appear in no row"),
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,\n", None),
])
def test_bad_cells(text, message):
    if message is None:
        assert read_csv(text).rows() == ["0F0 0B0", "1F0 1B0"]
        return
    with pytest.raises(ScheduleError, match=message):
        read_csv(text)


def test_missing_file_and_bad_format(tmp_path):
    with pytest.raises(ScheduleError, match=r"'.*nope.csv' does not exist"):
        read_csv(tmp_path / "nope.csv")
    with pytest.raises(ScheduleError, match=r"unknown CSV format 'xml'"):
        parse_csv("0F0,0B0", format="xml")


def test_overlap_note_in_validation_errors():
    with pytest.raises(ScheduleError, match=r"(?s)incomplete.*splitting 1 OVERLAP_F_B cell"):
        read_csv("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1\n1F0,1B0,1F1,1B1,1F2\n")


def test_write_is_torch_format():
    s = Schedule([[parse_action("0F0"), None, parse_action("0B0")]], (0,), 1)
    assert format_csv(s) == "0F0,,0B0\r\n"


@pytest.mark.parametrize("content, message", [
    (b"9999999F0,9999999B0", "9999999F0 names stage 9,999,999, but the file holds 2 action(s)"),
    (b"99999999F0", "99999999F0 names stage 99,999,999, but the file holds 1 action(s)"),
    (b"0F9999999,0B9999999", "0F9999999 names microbatch 9,999,999, but the file holds 2"),
    (b"9" * 5000 + b"F0", "its stage number has 5,000 digits"),
    (b"0F0,\xe90B0", "line 1: byte 0xe9 is not UTF-8 text"),
    (b"\x00\x01\x02", "holds NUL bytes: a binary file, not CSV text"),
    (b"0F0,\"" + b"x" * 200_000 + b"\"", "not CSV text (field larger than field limit"),
])
def test_hostile_csv_files_get_one_short_message(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(ScheduleError) as info:
        read_csv(path)
    assert message in str(info.value) and len(str(info.value)) < 600, str(info.value)[:600]


# ------------------------------------------------------------- torch 2.15's compute+comms dialect

# torch 2.15 ScheduleGPipe p=2 m=2, its order lowered by _PipelineScheduleRuntime, compute_comms
TORCH_215_GPIPE = (
    "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0RECV_B1,0B1,0WAIT_SEND_F1,"
    "0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD\r\n"
    "1UNSHARD,1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1,1REDUCE_GRAD,"
    "1WAIT_REDUCE_GRAD,1RESHARD,1WAIT_SEND_B0,1WAIT_SEND_B1\r\n")


def test_torch_215_compute_comms_loads():
    schedule = read_csv(TORCH_215_GPIPE)
    assert schedule.rows() == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]
    with pytest.raises(ScheduleError, match=r"'0UNSHARD' is a communication action, but "
                                            r"format='compute_only'"):
        read_csv(TORCH_215_GPIPE, format="compute_only")


def edited(old: str, new: str) -> str:
    assert old in TORCH_215_GPIPE
    return TORCH_215_GPIPE.replace(old, new, 1)


@pytest.mark.parametrize("text, message", [
    (edited(",0WAIT_SEND_F1", ""), r"row 0 \(rank 0\), column 4: '0SEND_F1' has no "
                                   r"'0WAIT_SEND_F1' after it; in torch 2.15's dialect"),
    (edited("0F0,0SEND_F0", "0F0,0WAIT_SEND_F0,0SEND_F0").replace("0B0,0WAIT_SEND_F0", "0B0"),
     r"'0WAIT_SEND_F0' waits for '0SEND_F0', which does not come before it"),
    (edited(",0WAIT_REDUCE_GRAD", ""), r"'0REDUCE_GRAD' is never waited; .* add "
                                       r"'0WAIT_REDUCE_GRAD'"),
    (edited("1B0,1SEND_B0", "1SEND_B0,1B0"), r"'1SEND_B0' comes before 1B0 \(column 6\)"),
    (edited("1RECV_F1,1F1", "1F1,1RECV_F1"), r"'1RECV_F1' comes after 1F1 \(column 3\)"),
    (edited("0WAIT_SEND_F0", "0WAIT_SEND_F"), r"'0WAIT_SEND_F' needs a microbatch number"),
    (edited("0WAIT_REDUCE_GRAD", "0WAIT_REDUCE_GRAD0"), r"WAIT_REDUCE_GRAD acts on a whole "
                                                        r"stage and takes no microbatch"),
    (edited("0RECV_B0", "1RECV_F0"), r"'1RECV_F0' names stage 1, which lives on rank 1"),
    (edited("0SEND_F0,", "").replace("0B0,", "0B0,0SEND_F0,"),
     r"(?s)its communication deadlocks in torch's runtime:\n  rank 0 column 5: 0B0 waits for "
     r"'1SEND_B0' \(row 1, column 6\), not reached\n  rank 1 column 2: 1F0 waits for '0SEND_F0'"),
    (edited("1RECV_F1,", ""), r"0F1 on rank 0 hands off to stage 1 on rank 1, but row 1 has no "
                              r"'1RECV_F1'"),
    (edited("0RECV_B1,0B1,0WAIT_SEND_F1,0REDUCE_GRAD,0WAIT_REDUCE_GRAD",
            "0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RECV_B1,0B1,0WAIT_SEND_F1"),
     r"'0REDUCE_GRAD' comes before a backward of stage 0"),
    (edited("0UNSHARD,", ""), r"'0RESHARD' is out of turn"),
    (edited("0UNSHARD,0F0", "0F0,0UNSHARD"), r"'0UNSHARD' and its RESHARD leave 0F0 \(column 0\) "
                                            r"outside"),
    (edited("0F1,0SEND_F1", "0F1,0SEND_F0"), r"'0SEND_F0' appears twice"),
])
def test_torch_215_cells_are_checked_with_torchs_meaning(text, message):
    with pytest.raises(ScheduleError, match=message):
        read_csv(text)


def test_pre_215_dialect_has_no_waits():
    """A file without any wait is torch 2.13-2.14's dialect: sends and reductions unwaited."""
    text = TORCH_215_GPIPE
    for cell in (",0WAIT_SEND_F0", ",0WAIT_SEND_F1", ",0WAIT_REDUCE_GRAD", ",1WAIT_REDUCE_GRAD",
                 ",1WAIT_SEND_B0", ",1WAIT_SEND_B1"):
        text = text.replace(cell, "")
    assert read_csv(text).rows() == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]


def test_export_writes_torchs_dialects():
    """pp-core's compute_comms export: 2.15's waits where torch's own lowering puts them; none
    in 2.13's; both read back."""
    from pp_core.schedule.build import build_schedule
    from pp_core.schedule.csv_io import format_comms_csv

    gpipe = read_csv(TORCH_215_GPIPE)
    text = format_comms_csv(gpipe, "2.15")
    # the cells torch 2.15 lowers, its sends, receives and waits in the same order (an UNSHARD
    # may stand on either side of a receive: both post and move on)
    assert [sorted(row.split(",")) for row in text.split()] == \
        [sorted(row.split(",")) for row in TORCH_215_GPIPE.split()]
    assert [[c for c in row.split(",") if "SHARD" not in c] for row in text.split()] == \
        [[c for c in row.split(",") if "SHARD" not in c] for row in TORCH_215_GPIPE.split()]
    older = format_comms_csv(gpipe, "2.13")
    assert "WAIT" not in older and read_csv(older).rows() == gpipe.rows()
    for name in ("zero_bubble", "v_schedule", "dualpipe_v", "interleaved_1f1b"):
        schedule = build_schedule(name, num_ranks=4, num_microbatches=8)
        assert read_csv(format_comms_csv(schedule, "2.15")).rows() == schedule.rows()
    with pytest.raises(ScheduleError, match=r"unknown torch CSV dialect '2.9'"):
        format_comms_csv(gpipe, "2.9")
