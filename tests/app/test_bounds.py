"""Every command's work is bounded before it starts, with a message naming the limit
(issue #25, class 3): the schedule commands' sizes, costs and processors, plan --top."""

from __future__ import annotations

import time

import pytest

from pp_core.app import cli
from pp_core.errors import ScheduleError
from pp_core.schedule.build import build_schedule
from pp_core.schedule.limits import MAX_CELLS, MAX_MICROBATCHES


@pytest.mark.parametrize("argv, expected", [
    (["simulate", "1f1b", "--pp", "2", "--microbatches", "100000000"],
     f"--microbatches=100,000,000 is more than pp-core's limit of {MAX_MICROBATCHES:,}"),
    (["show", "1f1b", "--pp", "100000", "--microbatches", "4"], "--pp=100,000 is more than"),
    (["export", "interleaved_1f1b", "--pp", "4", "-m", "8", "--stages-per-rank", "100000"],
     "--stages-per-rank=100,000 is more than"),
    (["simulate", "1f1b", "--pp", "1024", "--microbatches", "16384"],
     f"more than pp-core's limit of {MAX_CELLS:,} per schedule"),
])
def test_schedule_sizes_are_refused_before_any_work(capsys, argv, expected):
    started = time.perf_counter()
    code = cli.main(["schedule", *argv])
    err = capsys.readouterr().err
    assert code == 1 and expected in err, err
    assert time.perf_counter() - started < 5  # refused, not computed (was minutes or OOM)


@pytest.mark.parametrize("option, value, expected", [
    ("--processors", "1e-300", "expected a finite number >= 0.001"),
    ("--processors", "0", "expected a finite number >= 0.001"),
    ("--cost-f", "1e308", "is more than the limit 1e+12"),
    ("--cost-w", "0", "expected a finite number > 0"),
    ("--comm-latency", "1e300", "is more than the limit"),
    ("--activation-bytes", "1e300", "is more than the limit"),
])
def test_amounts_are_finite_and_bounded(capsys, option, value, expected):
    with pytest.raises(SystemExit) as info:
        cli.main(["schedule", "simulate", "1f1b", "--pp", "2", "-m", "4", option, value])
    assert info.value.code == 2 and expected in capsys.readouterr().err


def test_the_api_is_bounded_too():
    with pytest.raises(ScheduleError, match="num_microbatches=10,000,000 is more than"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=10_000_000)


def test_plan_top_zero_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", str(tmp_path / "pipe.yaml"), "--top", "0"])
    assert info.value.code == 2 and "expected an int >= 1, found '0'" in capsys.readouterr().err


SUPPORTED = "pp-core supports torch 2.13, 2.14 and 2.15"


@pytest.mark.parametrize("version, message", [
    ("2.15garbage", f"--torch '2.15garbage': expected a torch release such as 2.15 or 2.13.0 "
                    f"({SUPPORTED})"),
    ("２.１５", f"--torch '２.１５': expected a torch release such as 2.15 or 2.13.0 ({SUPPORTED})"),
    ("9" * 5000, f"--torch '{'9' * 60}'... (5,000 chars): expected a torch release such as 2.15 "
                 f"or 2.13.0 ({SUPPORTED})"),
    ("99.99", f"--torch 99.99: {SUPPORTED}; give the release that will load the file"),
    ("1.13", f"--torch 1.13: {SUPPORTED}; give the release that will load the file"),
    ("2.12", f"--torch 2.12: {SUPPORTED}; give the release that will load the file"),
])
def test_torch_release_is_parsed_strictly(capsys, version, message):
    """``--torch`` against the supported releases (issue #48, items 4 and 6): each was taken
    (a dialect guessed from a prefix) or a raw ValueError (5,000 digits)."""
    code = cli.main(["schedule", "export", "1f1b", "--pp", "2", "-m", "4", "--format",
                     "compute_comms", "--torch", version])
    out = capsys.readouterr()
    assert code == 1 and out.out == "" and out.err == f"pp-core: error: {message}\n", out.err


def test_supported_torch_releases_are_taken(capsys):
    for version in ("2.13", "2.14.1", "2.15.0+cpu", "2.15.0rc1"):
        assert cli.main(["schedule", "export", "1f1b", "--pp", "2", "-m", "4", "--format",
                         "compute_comms", "--torch", version]) == 0
        assert ("WAIT_SEND" in capsys.readouterr().out) == version.startswith("2.15")
