"""Sequence slices as schedule units (issue 47): build, validate, simulate, lower, CLI - in-process."""

from __future__ import annotations

import json

import pytest

from pp_core import ScheduleError
from pp_core.app.cli import main
from pp_core.schedule import slices
from pp_core.schedule.build import build_schedule
from pp_core.schedule.ir import Schedule, parse_action
from pp_core.schedule.lower import forward_only, lower
from pp_core.schedule.simulate import simulate
from pp_core.schedule.validate import validate_schedule

BUILT_IN = [("1f1b", None), ("gpipe", None), ("zero_bubble", None), ("interleaved_1f1b", 2),
            ("looped_bfs", 2), ("dfs", 2), ("v_schedule", None)]


@pytest.mark.parametrize("name,v", BUILT_IN)
def test_every_built_in_schedule_runs_with_slices(name, v):
    """Each schedule, cut into 2 and 4 slices, validates (slice edges included), lowers, and
    runs every microbatch's slices forward in order and backward in reverse on every stage."""
    for pp, m, k in ((2, 2, 2), (4, 8, 4)):
        schedule = build_schedule(name, num_ranks=pp, num_microbatches=m, stages_per_rank=v,
                                  seq_chunks=k)
        assert schedule.seq_chunks == k and schedule.num_sequences == m
        assert schedule.num_microbatches == m * k
        lower(schedule)
        lower(forward_only(schedule))
        for row in schedule.actions:
            order: dict = {}
            for a in row:
                order.setdefault((a.stage, a.kind.value in "BI", a.microbatch // k), []).append(
                    a.microbatch % k) if a.kind.value != "W" else None
            for (_, backward, _), pieces in order.items():
                assert pieces == (list(range(k))[::-1] if backward else list(range(k)))


def test_slice_edges_are_validated():
    """A slice's forward before the previous slice's on the same stage never runs."""
    rows = [[parse_action(a) for a in "0F1 0F0 0B1 0B0".split()]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate_schedule(Schedule(rows, (0,), 2, seq_chunks=2))
    rows = [[parse_action(a) for a in "0F0 0F1 0B0 0B1".split()]]  # backward in forward order
    with pytest.raises(ScheduleError, match=r"0B0 waits for 0B1 at rank 0 step 3"):
        validate_schedule(Schedule(rows, (0,), 2, seq_chunks=2))
    with pytest.raises(ScheduleError, match="seq_chunks=3 must be an int >= 1 that divides"):
        validate_schedule(Schedule(rows, (0,), 2, seq_chunks=3))


def test_1f1b_with_slices_is_seq1f1b():
    """Seq1F1B's figures: makespan (M*K + p - 1) (F + B) / K, rank r holds p - r + K - 1 slices;
    the docstring picture of :mod:`pp_core.schedule.slices` is the real order."""
    result = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8, seq_chunks=4))
    assert result.makespan == pytest.approx((8 * 4 + 3) * 3 / 4)
    assert result.peak_activations == [1.75, 1.5, 1.25, 1.0]
    plain = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8))
    assert result.peak_activations[0] <= 0.6 * plain.peak_activations[0]
    picture = [line.split(": ", 1)[1] for line in slices.__doc__.splitlines() if line.strip().startswith("rank ")]
    assert build_schedule("1f1b", num_ranks=2, num_microbatches=2, seq_chunks=2).rows() == picture


def test_a_csv_takes_no_slices(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\n")
    with pytest.raises(ScheduleError, match="seq_chunks=2 cannot run a schedule CSV"):
        build_schedule(csv_path=path, num_ranks=1, num_microbatches=1, seq_chunks=2)


def test_cli_simulate_and_show_with_seq_chunks(capsys):
    assert main(["schedule", "simulate", "1f1b", "--pp", "4", "-m", "8", "--seq-chunks", "4",
                 "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert {k: figures[k] for k in ("microbatches", "seq_chunks", "makespan", "bubble",
                                    "peak_activations")} == {
        "microbatches": 8, "seq_chunks": 4, "makespan": 26.25, "bubble": 2.25,
        "peak_activations": [1.75, 1.5, 1.25, 1]}
    assert main(["schedule", "show", "1f1b", "--pp", "2", "-m", "2", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "seq_chunks=2 (units are microbatch.slice)" in out
    assert out.splitlines()[1].startswith("rank0: 0F0.0 0F0.1 0F1.0")
    assert main(["schedule", "export", "1f1b", "--pp", "2", "-m", "2", "-k", "2"]) == 1
    assert capsys.readouterr().err.strip() == (
        "pp-core: error: --seq-chunks 2: a CSV (torch's format) orders whole microbatches and "
        "has no slices; export with --seq-chunks 1, or look at the sliced order with 'pp-core "
        "schedule show'")
