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
