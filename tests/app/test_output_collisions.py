"""Nothing a command writes lands on what it reads or on another of its outputs (issue #25,
class 1): ``validate`` and ``run`` refuse, naming both keys; the schedule commands refuse
``--csv X -o X``. Real files on disk, real commands."""

from __future__ import annotations

import os
import sys

import pytest

from pp_core.app import cli


GOOD = """\
model: {name: gpt, args: {dim: 16, num_layers: 2, num_heads: 2, max_seq_len: 8, vocab_size: 64}}
data: {name: synthetic, args: {seq_len: 8, vocab_size: 64}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 2}
train: {steps: 1}
"""


def _validate(tmp_path, capsys, extra: str, setup=None):
    (tmp_path / "pipe.yaml").write_text(GOOD + extra)
    if setup:
        setup(tmp_path)
    code = cli.main(["validate", "pipe.yaml"])
    return code, capsys.readouterr()


def _step_dir(tmp):
    (tmp / "ckpt" / "step_00000003").mkdir(parents=True)
    (tmp / "ckpt" / "step_00000003" / ".metadata").write_bytes(b"")


def _link(tmp):
    os.symlink("pipe.yaml", tmp / "alias.yaml")


def _hard_link(tmp):
    os.link(tmp / "pipe.yaml", tmp / "same.yaml")


def _data_file(tmp):
    (tmp / "tokens.txt").write_text("abc " * 200)


CASES = [  # (output lines, setup, the keys the refusal must name)
    ("output: {metrics: pipe.yaml}", None, ["output.metrics", "the pipeline file"]),
    ("output: {trace: ./sub/../pipe.yaml}", None, ["output.trace", "the pipeline file"]),
    ("output: {schedule_image: alias.yaml}", _link, ["output.schedule_image", "the pipeline file"]),
    ("output: {metrics: same.yaml}", _hard_link, ["output.metrics", "the pipeline file"]),
    ("output: {metrics: m.json, trace: m.json}", None, ["output.metrics", "output.trace"]),
    ("output: {metrics: m.json, schedule_image: ./m.json}", None,
     ["output.metrics", "output.schedule_image"]),
    ("checkpoint: {dir: out}\noutput: {metrics: out}", None, ["checkpoint.dir", "output.metrics"]),
    ("checkpoint: {dir: ckpt}\noutput: {metrics: ckpt/latest}", None,
     ["output.metrics", "checkpoint.dir", "'latest'"]),
    ("checkpoint: {dir: ckpt}\noutput: {trace: ckpt/step_00000002}", None,
     ["output.trace", "checkpoint.dir", "step_00000002"]),
    ("checkpoint: {dir: ckpt, resume: ckpt/step_00000003}\n"
     "output: {metrics: ckpt/step_00000003/m.jsonl}", _step_dir,
     ["output.metrics", "checkpoint"]),
    ("data: {name: text_bytes, args: {seq_len: 8, path: tokens.txt}}\n"
     "output: {metrics: tokens.txt}", _data_file, ["output.metrics", "data.args.path"]),
    ("output: {metrics: \"m\\0.json\"}", None, ["output.metrics", "NUL"]),
    ("output: {metrics: logs/}", None, ["output.metrics", "names a directory",
                                        "logs/metrics.jsonl"]),
]


@pytest.mark.parametrize("extra, setup, named", CASES, ids=[c[0][:40] for c in CASES])
def test_validate_refuses_outputs_that_overwrite(tmp_path, capsys, monkeypatch, extra, setup,
                                                 named):
    monkeypatch.chdir(tmp_path)
    if extra.startswith("data:"):  # the data section replaces GOOD's
        global_good = GOOD.replace("data: {name: synthetic, args: {seq_len: 8, vocab_size: 64}}\n",
                                   "")
        (tmp_path / "pipe.yaml").write_text(global_good + extra)
        if setup:
            setup(tmp_path)
        code, out = cli.main(["validate", "pipe.yaml"]), capsys.readouterr()
    else:
        code, out = _validate(tmp_path, capsys, extra, setup)
    assert code == 1, out.out
    for word in named:
        assert word in out.err, out.err
    assert "Traceback" not in out.err
    assert (tmp_path / "pipe.yaml").read_text().startswith("model:")  # nothing was written


def test_outputs_beside_the_checkpoints_and_a_resume_inside_them_are_fine(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _validate(tmp_path, capsys, "checkpoint: {dir: ckpt, resume: ckpt/step_00000003}\n"
                          "output: {metrics: ckpt/metrics.jsonl, trace: trace.json}", _step_dir)
    assert "output.metrics" not in out.err and "checkpoint.dir" not in out.err, out.err


@pytest.mark.cli
@pytest.mark.ranks
def test_run_refuses_before_any_rank_starts_and_leaves_the_file(tmp_path, capsys, monkeypatch):
    """The command in this process (cli.main): refused before any rank starts."""
    (tmp_path / "pipe.yaml").write_text(GOOD + "output: {metrics: pipe.yaml}\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "pipe.yaml"])
    result = capsys.readouterr()
    assert code == 1, result.out + result.err
    assert "output.metrics" in result.err and "the pipeline file" in result.err
    assert "Traceback" not in result.err and "rank" not in result.out
    assert (tmp_path / "pipe.yaml").read_text() == GOOD + "output: {metrics: pipe.yaml}\n"


@pytest.mark.parametrize("argv, named", [
    (["show", "--csv", "s.csv", "-o", "s.csv"], ["-o", "--csv"]),
    (["simulate", "--csv", "s.csv", "-o", "./s.csv"], ["-o", "--csv"]),
    (["simulate", "--csv", "s.csv", "--trace", "s.csv"], ["--trace", "--csv"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "-o", "f.json", "--trace", "f.json"],
     ["-o", "--trace"]),
    (["export", "--csv", "s.csv", "-o", "s.csv"], ["-o", "--csv"]),
])
def test_schedule_commands_refuse_writing_over_their_input(tmp_path, capsys, monkeypatch, argv,
                                                           named):
    monkeypatch.chdir(tmp_path)
    text = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    (tmp_path / "s.csv").write_text(text)
    code = cli.main(["schedule", *argv])
    err = capsys.readouterr().err
    assert code == 1 and all(flag in err for flag in named), err
    assert (tmp_path / "s.csv").read_text() == text


def test_schedule_csv_with_a_byte_order_mark_and_full_width_digits(tmp_path, capsys):
    path = tmp_path / "s.csv"
    path.write_bytes("\ufeff0F0,0B0\n".encode())  # what Notepad writes
    assert cli.main(["schedule", "simulate", "--csv", str(path), "--json"]) == 0
    capsys.readouterr()
    path.write_text("\uff10F0,0B0\n")  # a full-width zero is no stage number
    assert cli.main(["schedule", "simulate", "--csv", str(path)]) == 1
    assert "cannot parse action" in capsys.readouterr().err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
