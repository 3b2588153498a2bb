"""``pp-core schedule show|simulate|export`` end to end through pp_core.app.cli.main."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from pp_core.app.cli import main
from pp_core.schedule.csv_io import read_csv
from tests.fixtures.reference_examples import SUPPORTED


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json(capsys):
    code, out, _ = run(capsys, "schedule", "simulate", "1f1b", "--pp", "4", "--microbatches", "8",
                       "--json")
    assert code == 0
    figures = json.loads(out)
    assert {k: figures[k] for k in ("schedule", "pp", "num_stages", "microbatches", "makespan",
                                    "bubble_ratio", "peak_activations")} == {
        "schedule": "1f1b", "pp": 4, "num_stages": 4, "microbatches": 8, "makespan": 33,
        "bubble_ratio": 0.272727, "peak_activations": [4, 3, 2, 1]}
    assert figures["busy"] == [24] * 4 and figures["span_bubble"] == 9


def test_simulate_table_costs_trace_and_output(capsys, tmp_path):
    trace, figures = tmp_path / "t.json", tmp_path / "f.json"
    code, out, _ = run(capsys, "schedule", "simulate", "1f1b", "--pp", "2", "-m", "4",
                       "--cost-b", "3", "--comm-latency", "0.5", "--activation-bytes", "100",
                       "--trace", str(trace), "-o", str(figures))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("1f1b: pp=2, microbatches=4 [F=1 B=3 I=1 W=1 latency=0.5]")
    assert lines[1].split() == ["rank", "stages", "busy", "idle", "peak", "act.", "peak", "bytes"]
    assert lines[2].split()[:3] == ["0", "0", "16"]
    assert json.loads(figures.read_text())["costs"]["B"] == 3
    assert json.loads(figures.read_text())["peak_activation_bytes"] == [200, 100]
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 16


def test_show_text_and_svg(capsys, tmp_path):
    svg = tmp_path / "s.svg"
    code, out, _ = run(capsys, "schedule", "show", "gpipe", "--pp", "4", "--microbatches", "4",
                       "-o", str(svg))
    assert code == 0
    lines = out.splitlines()
    gpipe = next(e for e in SUPPORTED if e["title"] == "GPipe p=4 m=4")
    assert lines[1:5] == gpipe["timeline"]
    assert "makespan 21" in lines[0] and lines[-1] == f"wrote {svg}"
    ET.fromstring(svg.read_text())


def test_show_json(capsys):
    code, out, _ = run(capsys, "schedule", "show", "1f1b", "--pp", "2", "-m", "2", "--json")
    data = json.loads(out)
    assert data["rows"] == ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]
    assert data["timeline_text"][1] == "rank1: .   1F0 1B0 ~   1F1 1B1 ~"


def test_show_takes_a_pipeline_file(capsys, tmp_path):
    """``schedule show PIPELINE.yaml`` (issue #49, item 6) draws the file's schedule at its pp,
    microbatches and stages per rank, as a name with the same flags does; it answered
    "unknown schedule 'examples/demo.yaml'"."""
    (tmp_path / "pipe.yaml").write_text(
        "pipeline: {pp_schedule: interleaved_1f1b, pp_batch_size: 8, pp_microbatch_size: 2,\n"
        "           module_fqns_per_model_part: [[a], [b], [c], [d]]}\n"
        "distributed: {pp_size: 2}\n")
    named = run(capsys, "schedule", "show", "interleaved_1f1b", "--pp", "2", "-m", "4", "-v", "2")
    assert run(capsys, "schedule", "show", str(tmp_path / "pipe.yaml")) == named
    assert named[0] == 0 and "interleaved_1f1b" in named[1].splitlines()[0]
    code, out, err = run(capsys, "schedule", "show", str(tmp_path / "pipe.yaml"), "--pp", "4")
    assert code == 0 and out.count("rank") >= 4  # a flag given wins over the file
    (tmp_path / "auto.yaml").write_text("pipeline: {pp_schedule: auto}\n")
    assert run(capsys, "schedule", "show", str(tmp_path / "auto.yaml")) == (1, "", (
        f"pp-core: error: {tmp_path / 'auto.yaml'}: pipeline.pp_schedule: auto is chosen when "
        f"the run starts; 'pp-core plan {tmp_path / 'auto.yaml'}' shows the choice\n"))


def test_export_stdout_and_file_round_trip(capsys, tmp_path):
    code, out, _ = run(capsys, "schedule", "export", "1f1b", "--pp", "2", "-m", "2")
    assert code == 0 and out == "0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"
    path = tmp_path / "o.csv"
    code, out, _ = run(capsys, "schedule", "export", "Schedule1F1B", "--pp", "4", "-m", "8",
                       "-o", str(path))
    assert code == 0 and out == f"wrote {path}: 1f1b, pp=4, microbatches=8 (4 rows, one per rank)\n"
    expected = next(e for e in SUPPORTED if e["title"] == "1F1B p=4 m=8")["rows"]
    assert read_csv(path).rows() == expected
    code, out, _ = run(capsys, "schedule", "simulate", "--csv", str(path), "--json")
    assert json.loads(out)["makespan"] == 33 and json.loads(out)["schedule"] == "o"
    code, out, _ = run(capsys, "schedule", "show", "--csv", str(path), "--pp", "4", "-m", "8")
    assert code == 0 and "rank3:" in out
    code, out, _ = run(capsys, "schedule", "export", "--csv", str(path))
    assert out == path.read_bytes().decode()


def test_export_compute_comms_in_each_torch_dialect(capsys, tmp_path, monkeypatch):
    path = tmp_path / "zb.csv"
    code, out, _ = run(capsys, "schedule", "export", "zero_bubble", "--pp", "2", "-m", "4",
                       "--format", "compute_comms", "--torch", "2.15.0", "-o", str(path))
    assert code == 0 and out.endswith("(2 rows, one per rank, compute_comms for torch 2.15+)\n")
    text = path.read_text()
    assert "0WAIT_SEND_F0" in text and "1WAIT_SEND_B3" in text and "WAIT_REDUCE_GRAD" in text
    assert read_csv(path).rows() == ["0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
                                     "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"]
    code, out, _ = run(capsys, "schedule", "export", "zero_bubble", "--pp", "2", "-m", "4",
                       "--format", "compute_comms", "--torch", "2.13")
    assert code == 0 and "SEND_F" in out and "REDUCE_GRAD" in out and "WAIT" not in out
    # no --torch: the installed torch's dialect, read from its metadata
    monkeypatch.setattr("pp_core.app.commands.schedule.installed_torch_version", lambda: "2.14.1")
    code, out, _ = run(capsys, "schedule", "export", "1f1b", "--pp", "2", "-m", "2",
                       "--format", "compute_comms")
    assert code == 0 and "WAIT" not in out
    monkeypatch.setattr("pp_core.app.commands.schedule.installed_torch_version", lambda: None)
    code, out, _ = run(capsys, "schedule", "export", "1f1b", "--pp", "2", "-m", "2",
                       "--format", "compute_comms")
    assert code == 0 and "0WAIT_SEND_F0" in out


@pytest.mark.parametrize("argv,message", [
    (["export", "1f1b", "--pp", "2", "-m", "2", "--torch", "2.15"],
     "--torch chooses the dialect of a compute_comms file; add --format compute_comms"),
    (["export", "1f1b", "--pp", "2", "-m", "2", "--format", "compute_comms", "--torch", "next"],
     "--torch 'next': expected a torch release such as 2.15 or 2.13.0"),
    (["show", "nope", "--pp", "2", "-m", "2"], "unknown schedule 'nope'"),
    (["show", "1f1b", "--pp", "2"], "schedule '1f1b' needs --microbatches"),
    (["show"], "name a schedule"),
    (["show", "gpipe", "--pp", "2", "-m", "2", "-v", "2"], "runs exactly 1 stage(s) per rank"),
    (["show", "gpipe", "--pp", "0", "-m", "2"], "num_ranks must be an integer >= 1, got 0"),
    (["show", "1f1b", "--csv", "x.csv"], "give a schedule NAME or --csv FILE, not both"),
    (["export", "--csv", "missing.csv"], "'missing.csv' does not exist"),
])
def test_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, "schedule", *argv)
    assert code == 1 and out == ""
    assert err.startswith("pp-core: error: ") and message in err
    assert err.count("\n") == 1 or "grid" in err


def test_csv_size_mismatch(capsys, tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0B0\r\n1F0,1B0\r\n")
    code, _, err = run(capsys, "schedule", "simulate", "--csv", str(path), "--pp", "4")
    assert code == 1 and "has 2 rows (one per rank), but the pipeline has num_ranks=4" in err
    path.write_text("0F0,0B0\r\n1B0,1F0\r\n")
    code, _, err = run(capsys, "schedule", "simulate", "--csv", str(path))
    assert code == 1 and "1B0 comes before its forward 1F0" in err and "[1B0]" in err


@pytest.mark.cli
def test_help_has_examples():
    out = subprocess.run([sys.executable, "-m", "pp_core", "schedule", "simulate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--cost-w" in out and "--csv FILE" in out and "pp-core schedule export" in out


def test_show_refuses_a_text_timeline_too_large_to_draw(capsys, tmp_path):
    svg = tmp_path / "s.svg"
    code, out, err = run(capsys, "schedule", "show", "1f1b", "--pp", "2000", "--microbatches",
                         "1", "-o", str(svg))  # 2,000 rows of up to 6,000 slots
    assert code == 1 and out == "" and not svg.exists()
    assert err.startswith("pp-core: error: the text timeline of 1f1b at pp=2000") \
        and err.count("\n") == 1 and "use 'pp-core schedule simulate'" in err, err


@pytest.mark.parametrize("option, value", [
    ("--cost-b", "nan"), ("--cost-f", "-1"), ("--comm-latency", "inf"),
    ("--activation-bytes", "nan"), ("--recv-bytes", "-5"),
])
def test_non_finite_or_negative_numbers_are_refused(capsys, option, value):
    with pytest.raises(SystemExit) as info:
        main(["schedule", "simulate", "1f1b", "--pp", "2", "--microbatches", "4",
              f"{option}={value}"])
    _, err = capsys.readouterr()
    assert info.value.code == 2
    low = "> 0" if option.startswith("--cost-") else ">= 0"  # a cost of 0 makes bubble 0/0
    assert f"argument {option}: expected " in err and f"{low}, found '{value}'" in err, err
