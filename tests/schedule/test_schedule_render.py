"""Text and SVG pictures: the reference's timelines character for character; a well-formed SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from pp_core.schedule.render import COLOURS, caption, render_svg, render_text
from pp_core.schedule.simulate import Costs, simulate
from tests.fixtures.generators import one_f_one_b
from tests.fixtures.reference_examples import SUPPORTED, make_schedule

WITH_TIMELINE = [e for e in SUPPORTED if "timeline" in e]


@pytest.mark.parametrize("example", WITH_TIMELINE, ids=[e["title"] for e in WITH_TIMELINE])
def test_text_timeline_matches_reference(example):
    assert render_text(simulate(make_schedule(example))).splitlines() == example["timeline"]


def test_text_timeline_fractional_costs_use_smaller_slots():
    text = render_text(simulate(one_f_one_b(2, 1), Costs(F=0.5, B=1)))
    assert text.splitlines() == ["rank0: 0F0 .   .   .   0B0 ~", "rank1: .   1F0 1B0 ~"]


def test_text_timeline_wide_labels_and_many_ranks():
    text = render_text(simulate(one_f_one_b(11, 11)))
    lines = text.splitlines()
    assert lines[0].startswith("rank0:  0F0   0F1   ")
    assert lines[10].startswith("rank10: .     .     ")
    assert "10F10" in lines[10]


def test_caption():
    result = simulate(one_f_one_b(4, 8))
    assert caption(result) == ("1f1b: pp=4, microbatches=8 [F=1 B=2 I=1 W=1] — makespan 33, "
                               "bubble 9 (ratio 0.273), span bubble 9, peak activations per rank "
                               "4 3 2 1")


def test_svg_is_well_formed_and_complete():
    example = next(e for e in SUPPORTED if e["title"] == "ZB-H1 p=4 m=8")
    result = simulate(make_schedule(example))
    svg = render_svg(result)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    rects = root.iter(f"{ns}rect")
    fills = [r.get("fill") for r in rects]
    assert fills.count(COLOURS["F"]) == 32 + 1  # 32 forwards + legend
    assert fills.count(COLOURS["I"]) == 33 and fills.count(COLOURS["W"]) == 33
    assert fills.count("url(#idle)") == 4 + 1  # one hatched background per rank + legend
    texts = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
    assert "makespan 27" in texts and "ratio 0.111" in texts
    assert "peak activations per rank 4 4 4 4" in texts
    assert "rank 3" in texts


def test_the_run_picture_draws_the_measured_step_above_the_same_step_simulated():
    """``output.schedule_image`` of a run: the median steady step as measured (compute actions
    in their colours, a wait hatched as a wait, a send as a thin grey bar) above the same step
    simulated with its own action times, one axis in ms, each row labelled with its share of
    the step outside F/B/I/W."""
    from pp_core.schedule.run_picture import MeasuredRank, render_run_svg, steady_step, step_costs

    def step(number, start, length):  # rank 1 waits for rank 0's forward, then runs
        return [[("0F0", "forward", start, start + length, number),
                 ("0SEND_F0", "comm", start + length, start + length * 1.1, number),
                 ("0B0", "backward", start + length * 3, start + length * 5, number)],
                [("wait 1F0", "wait", start, start + length, number),
                 ("1F0", "forward", start + length, start + length * 2, number),
                 ("1B0", "backward", start + length * 2, start + length * 4, number)]]

    steps = [step(1, 0.0, 0.05), step(2, 1.0, 0.010), step(3, 2.0, 0.012), step(4, 3.0, 0.030)]
    per_rank = [[e for s in steps for e in s[rank]] for rank in range(2)]
    assert steady_step(per_rank) == 3  # the first left out; the median of 10, 12, 30 ms
    chosen = [MeasuredRank(rank, [e[:4] for e in events if e[4] == 3])
              for rank, events in zip((0, 1), per_rank)]
    costs = step_costs(chosen)
    assert costs == {0: {"F": pytest.approx(0.012), "B": pytest.approx(0.024)},
                     1: {"F": pytest.approx(0.012), "B": pytest.approx(0.024)}}
    svg = render_run_svg(chosen, simulate(one_f_one_b(2, 1), Costs(per_stage=costs)), 3)
    root = ET.fromstring(svg)  # well-formed
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "measured, step 3 (60.0 ms)" in texts and "simulated (72.0 ms)" in texts
    assert ["bubble 40.0% measured", "bubble 40.0% measured", "bubble 50.0% simulated",
            "bubble 50.0% simulated"] == [t.strip() for t in texts if t.startswith("bubble ")]
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert "wait 1F0 0.00-12.00 ms" in titles and "0SEND_F0 12.00-13.20 ms" in titles
    assert "0B0 48.00-72.00 ms" in titles  # simulated, on the same axis
    fills = {r.get("fill") for r in root.iter("{http://www.w3.org/2000/svg}rect")}
    assert {"url(#wait)", COLOURS["F"], COLOURS["B"]} <= fills
    assert steady_step([]) is None and steady_step([per_rank[0][:1]]) == 1
