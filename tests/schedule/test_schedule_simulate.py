"""simulate(): the reference's measured figures, unequal costs, latency, bytes, Chrome trace."""

from __future__ import annotations

import json

import pytest

from pp_core import ScheduleError
from pp_core.schedule.ir import Schedule, parse_action
from pp_core.schedule.simulate import Costs, simulate
from pp_core.schedule.trace import chrome_trace, write_chrome_trace
from tests.fixtures.generators import interleaved_zero_bubble, one_f_one_b
from tests.fixtures.reference_examples import SUPPORTED, make_schedule

# DualPipeV's OVERLAP_F_B pairs are split into their two halves, run one after the other, each
# waiting only for its own input: what torch's runtime does without a registered overlap
# function. The reference timed each pair as one atomic F+B unit (both inputs ready first), which
# costs one more slot per rank on the critical path: 26/2/2 and 54/6/6 there.
SPLIT_OVERLAP = {
    "DualPipeV p=2 m=4": (25, 1, 1),
    "DualPipeV p=4 m=8": (51, 3, 3),
}


@pytest.mark.parametrize("example", SUPPORTED, ids=[e["title"] for e in SUPPORTED])
def test_reference_worked_examples(example):
    result = simulate(make_schedule(example))
    expected = SPLIT_OVERLAP.get(
        example["title"], (example["makespan"], example["bubble"], example["span_bubble"]))
    assert (result.makespan, result.bubble, result.span_bubble) == expected
    assert result.peak_activations == example["peaks"]


@pytest.mark.parametrize("p,m,makespan,bubble,ratio", [
    (4, 8, 33, 9, 0.273), (4, 16, 57, 9, 0.158), (8, 32, 117, 21, 0.179)])
def test_1f1b_table(p, m, makespan, bubble, ratio):
    result = simulate(one_f_one_b(p, m))
    figures = (result.makespan, result.bubble, round(result.bubble_ratio, 3))
    assert figures == (makespan, bubble, ratio)
    assert result.peak_activations == [min(m, p - r) for r in range(p)]
    assert result.busy == [3 * m] * p and result.idle == [bubble] * p


def test_section4_zero_bubble_rows():
    # ZB-H1 p=8 m=32: 7 (0.068); InterleavedZeroBubble p=4 m=16: 99 / 3; p=8 m=32 v=2: 7 (0.035)
    r = simulate(interleaved_zero_bubble(8, 32, 1))
    assert (r.bubble, round(r.bubble_ratio, 3)) == (7, 0.068)
    r = simulate(interleaved_zero_bubble(4, 16, 2))
    assert (r.makespan, r.bubble, r.peak_activations) == (99, 3, [8, 8, 8, 8])
    r = simulate(interleaved_zero_bubble(8, 32, 2))
    assert (r.bubble, round(r.bubble_ratio, 3)) == (7, 0.035)


def test_unequal_costs_match_formula():
    """Reference 4: ZB-H1 p=4 m=16, F=1 I=1.2 W=0.8 -> (p-1)(F+I-W) = 4.2; interleaved: 2.1."""
    r = simulate(interleaved_zero_bubble(4, 16, 1), Costs(F=1, I=1.2, W=0.8))
    assert r.bubble == pytest.approx(4.2)
    r = simulate(interleaved_zero_bubble(4, 16, 2), Costs(F=0.5, I=0.6, W=0.4))
    assert r.bubble == pytest.approx(2.1)
    assert r.to_dict()["bubble"] == 2.1


def test_per_stage_costs_and_latency():
    s = one_f_one_b(2, 2)
    base = simulate(s)
    assert base.makespan == 9
    heavy_last = simulate(s, Costs(per_stage={1: {"F": 2, "B": 4}}))
    # rank 1 now does 2*(2+4) = 12 units of work after its first input at t=1
    assert heavy_last.busy == [6, 12] and heavy_last.makespan == 15
    lat = simulate(s, comm_latency=0.5)
    # every cross-rank hand-off on the critical path (0F0->1F0, 1B0->0B0, ...) costs 0.5 more
    assert lat.makespan == 10.0
    timeline = lat.timeline
    assert [(str(a), t0, t1) for a, t0, t1 in timeline[1][:2]] == [("1F0", 1.5, 2.5),
                                                                    ("1B0", 2.5, 4.5)]


def test_same_rank_handoff_has_no_latency():
    example = next(e for e in SUPPORTED if e["title"] == "ZBV p=2 m=4")
    s = make_schedule(example)
    r = simulate(s, comm_latency=0.25)
    # stage 1 -> 2 lives on rank 1: 2F0 starts right after 1F0 ends (no latency added)
    row = {str(a): (t0, t1) for a, t0, t1 in r.timeline[1]}
    assert row["2F0"][0] == row["1F0"][1]
    assert row["1F0"][0] == 1.25


def test_activation_bytes():
    s = one_f_one_b(4, 8)
    r = simulate(s, activation_bytes=1000)
    assert r.peak_activation_bytes == [4000, 3000, 2000, 1000]
    example = next(e for e in SUPPORTED if e["title"] == "Interleaved1F1B p=2 m=4 v=2")
    r = simulate(make_schedule(example), activation_bytes=[1, 10, 100, 1000])
    assert r.peak_activations == [5, 3]
    assert r.to_dict()["peak_activation_bytes"][0] <= 2 * 1 + 3 * 100 + 1000
    with pytest.raises(ScheduleError, match=r"activation_bytes has 2 entries; give one per stage"):
        simulate(s, activation_bytes=[1, 2])


def test_idle_cells_do_not_change_the_timing():
    s = one_f_one_b(2, 3)
    padded = Schedule([[None, *s.actions[0]], [None, None, *s.actions[1]]], s.stage_ranks, 3)
    rename = {"schedule": "x"}
    assert simulate(padded).to_dict() | rename == simulate(s).to_dict() | rename


def test_bad_costs_and_invalid_schedules():
    with pytest.raises(ScheduleError, match=r"cost B must be a number >= 0"):
        Costs(B=-1)
    with pytest.raises(ScheduleError, match=r"per-stage cost for stage 0 names kind 'X'"):
        Costs(per_stage={0: {"X": 1}})
    with pytest.raises(ScheduleError, match=r"per-stage cost names stage 7"):
        simulate(one_f_one_b(2, 2), Costs(per_stage={7: {"F": 1}}))
    with pytest.raises(ScheduleError, match=r"comm_latency must be a number >= 0"):
        simulate(one_f_one_b(2, 2), comm_latency=-1)
    bad = Schedule([[parse_action(a) for a in "0F0 0B0 0F1 0B1".split()],
                    [parse_action(a) for a in "1F0 1F1 1B0 1B1".split()]], (0, 1), 2)
    with pytest.raises(ScheduleError, match=r"deadlocks at rank 0 step 1 \(0B0\)"):
        simulate(bad)


def test_to_dict_is_json():
    d = simulate(one_f_one_b(4, 8)).to_dict(timeline=True)
    text = json.dumps(d)
    assert json.loads(text)["timeline"][3][:2] == [["3F0", 3, 4], ["3B0", 4, 6]]
    for key in ("schedule", "pp", "num_stages", "microbatches", "makespan", "bubble_ratio",
                "peak_activations", "span_bubble", "busy"):
        assert key in d


def test_chrome_trace(tmp_path):
    result = simulate(one_f_one_b(2, 2))
    trace = chrome_trace(result)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 8 and {e["tid"] for e in spans} == {0, 1}
    first = next(e for e in spans if e["name"] == "1F0")
    assert (first["ts"], first["dur"], first["args"]["microbatch"]) == (1000, 1000, 0)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    assert names == ["rank 0 (stages 0)", "rank 1 (stages 1)"]
    path = tmp_path / "t.json"
    write_chrome_trace(result, path)
    assert json.loads(path.read_text())["traceEvents"][0]["ph"] == "M"


class _CountingPlacement(tuple):
    """``stage_ranks`` that counts how often something walks through all of it."""

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def _scans_to_simulate_and_report(pp: int) -> int:
    from pp_core.schedule.build import build_schedule
    from pp_core.schedule.render import caption

    schedule = build_schedule("1f1b", num_ranks=pp, num_microbatches=1)
    schedule.stage_ranks = placement = _CountingPlacement(schedule.stage_ranks)
    placement.scans = 0
    result = simulate(schedule)
    result.to_dict()
    caption(result)
    chrome_trace(result)
    for rank in range(pp):  # what the simulate table prints per rank
        schedule.stages_of(rank)
    return placement.scans


def test_simulate_scans_the_stage_placement_a_fixed_number_of_times_whatever_pp():
    """Asking each rank's stages used to scan every stage per call: quadratic in pp (pp=32,000
    took 76 s). The per-rank map is built once, so the scans do not grow with pp."""
    small, large = _scans_to_simulate_and_report(100), _scans_to_simulate_and_report(1000)
    assert small == large <= 4


def test_stages_of_follows_a_new_placement():
    schedule = Schedule([[parse_action("0F0")], [parse_action("1F0")]], (0, 1), 1)
    assert [schedule.stages_of(r) for r in (0, 1, 2)] == [(0,), (1,), ()]
    schedule.stage_ranks = (1, 0)
    assert [schedule.stages_of(r) for r in (0, 1)] == [(1,), (0,)]


def _one_rank(text: str, stages: int = 1) -> Schedule:
    return Schedule([[parse_action(a) for a in text.split()]], (0,) * stages, 2)


def test_input_grad_held_bytes_count_from_each_i_to_its_w():
    """Saved 100 per F, 10 more per I until its W. The peak is taken after an F and before
    every other action (an I's own additions are its temporaries while it runs):
    F0 100, F1 200, I0 (before 200) 210, I1 (before 210) 220, W0 (before 220) 110, W1 0."""
    deferred = _one_rank("0F0 0F1 0I0 0I1 0W0 0W1")
    assert simulate(deferred, activation_bytes=100).peak_activation_bytes == [200]
    held = simulate(deferred, activation_bytes=100, input_grad_held_bytes=10)
    assert held.peak_activation_bytes == [220]
    # each W right after its I: the 10 are held only once at a time, after an F never
    eager = _one_rank("0F0 0I0 0W0 0F1 0I1 0W1")
    assert simulate(eager, activation_bytes=100, input_grad_held_bytes=[10]) \
        .peak_activation_bytes == [110]
    # a whole backward (B) holds nothing from I to W; per stage values; without activations
    # (0F0 100, 1F0 1100, 1B0 100, 0I0 110, 0F1 210, 1F1 1210, 1B1 210, 0I1 220, ...)
    whole = _one_rank("0F0 1F0 1B0 0I0 0F1 1F1 1B1 0I1 0W0 0W1", stages=2)
    assert simulate(whole, activation_bytes=[100, 1000],
                    input_grad_held_bytes=[10, 10 ** 6]).peak_activation_bytes == [1210]
    assert simulate(deferred, input_grad_held_bytes=7).peak_activation_bytes == [14]
    with pytest.raises(ScheduleError, match=r"input_grad_held_bytes has 2 entries"):
        simulate(deferred, input_grad_held_bytes=[1, 2])


def test_a_floor_counts_what_each_action_holds_beside_the_activations():
    """``floor``: bytes beside the saved activations while each action runs (receive
    buffers). A zero floor gives the plain replay; 50 at the second forward add to the peak
    there (200 + 50); 30 at the last W, where 110 are saved, do not; 500 there do (610)."""
    from pp_core.schedule.peak_bytes import peak_activation_bytes

    deferred = _one_rank("0F0 0F1 0I0 0I1 0W0 0W1")
    for transient in (None, [5]):
        plain = peak_activation_bytes(deferred, [100], [10], transient_bytes=transient)
        zero = peak_activation_bytes(deferred, [100], [10], transient_bytes=transient,
                                     floor=[[0] * 6])
        assert zero == plain
    assert peak_activation_bytes(deferred, [100], [10], floor=[[0, 50, 0, 0, 0, 30]]) == [250]
    assert peak_activation_bytes(deferred, [100], [10], floor=[[0, 0, 0, 0, 0, 500]]) == [610]
