"""No output lands inside what a command reads (issue #34, class 1): ``export -o`` onto or into
the checkpoint it reads, and ``run``/``validate`` outputs inside a corpus directory or matching a
corpus glob, are refused with one line before anything is written. Real files, the real
``pp-core`` command."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import save_checkpoint
from pp_core_builtins.models import GPT

from tests.cases.cli import PP_CORE

MODEL = {"vocab_size": 32, "dim": 8, "num_layers": 2, "num_heads": 2, "max_seq_len": 8}


def _pp_core(*argv, cwd):
    return subprocess.run([PP_CORE, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    save_checkpoint(root / "ckpt", 2, [GPT(**MODEL)], [None])
    return root


EXPORTS = [  # (CKPT argument, -o, what the one line must name)
    ("ckpt/step_00000002", "ckpt/step_00000002/__0_0.distcp", ["-o", "inside CKPT"]),
    ("ckpt/step_00000002", "ckpt/step_00000002/.metadata", ["-o", "inside CKPT"]),
    ("ckpt/step_00000002", "ckpt/step_00000002/model.pt", ["-o", "inside CKPT"]),
    ("ckpt/step_00000002", "ckpt/step_00000002", ["-o", "is CKPT"]),
    ("ckpt", "ckpt/step_00000002/__0_0.distcp", ["-o", "inside CKPT"]),
    ("ckpt", "ckpt/latest", ["-o", "'latest'", "inside CKPT"]),
    ("ckpt", "./ckpt/../ckpt/step_00000002/.metadata", ["-o", "inside CKPT"]),
]


def _in_process(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("source, output, named", EXPORTS, ids=[e[1] for e in EXPORTS])
def test_export_refuses_writing_into_the_checkpoint_it_reads(ckpt, capsys, monkeypatch, source,
                                                             output, named):
    monkeypatch.chdir(ckpt)
    before = _digests(ckpt / "ckpt" / "step_00000002")
    latest = (ckpt / "ckpt" / "latest").read_text()
    code, out, err = _in_process(capsys, "export", source, "-o", output)
    assert code == 1 and out == "", out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pp-core: error: -o "), err
    assert all(word in lines[0] for word in named), lines[0]
    assert _digests(ckpt / "ckpt" / "step_00000002") == before
    assert (ckpt / "ckpt" / "latest").read_text() == latest


@pytest.mark.cli
def test_the_reported_export_is_refused_by_the_real_command_and_the_checkpoint_stays_whole(ckpt):
    before = _digests(ckpt / "ckpt" / "step_00000002")
    done = _pp_core("export", "ckpt/step_00000002", "-o", "ckpt/step_00000002/__0_0.distcp",
                    cwd=ckpt)
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == (
        "pp-core: error: -o 'ckpt/step_00000002/__0_0.distcp' lies at '__0_0.distcp' inside "
        "CKPT 'ckpt/step_00000002', which this command reads: writing there changes its input; "
        "choose another place\n")
    assert _digests(ckpt / "ckpt" / "step_00000002") == before


def test_export_beside_the_checkpoints_is_fine(ckpt, capsys, monkeypatch):
    monkeypatch.chdir(ckpt)
    code, out, err = _in_process(capsys, "export", "ckpt", "-o", "ckpt/model.pt")
    assert code == 0 and err == "", err
    assert (ckpt / "ckpt" / "model.pt").is_file()


GOOD = """\
model: {name: gpt, args: {dim: 16, num_layers: 2, num_heads: 2, max_seq_len: 8, vocab_size: 256}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 2}
train: {steps: 1}
"""
CORPUS = "data: {name: tokenized_text, args: {files: %s, tokenizer: bytes, seq_len: 8, " \
         "cache_dir: cache}}\n"

INSIDE = [  # (files, the outputs, the keys the line must name)
    ("corpus", "output: {metrics: corpus/metrics.jsonl}", ["output.metrics", "data.args.files",
                                                           "inside"]),
    ("corpus", "output: {trace: corpus/sub/trace.json}", ["output.trace", "data.args.files"]),
    ("corpus", "checkpoint: {dir: corpus/ckpt}", ["checkpoint.dir", "data.args.files"]),
    ("'corpus/*.jsonl'", "output: {metrics: corpus/m.jsonl}",
     ["output.metrics", "matches data.args.files", "corpus/*.jsonl"]),
    ("'corpus/**'", "output: {metrics: corpus/deep/m.txt}", ["output.metrics", "matches"]),
    ("'corp*'", "output: {metrics: corpus/m.jsonl}", ["output.metrics", "matches"]),
    ("['corpus/a.txt', 'corpus/*.jsonl']", "output: {metrics: corpus/x.jsonl}",
     ["output.metrics", "matches"]),
]


def _corpus(tmp: Path) -> None:
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("hello world, " * 40)
    (tmp / "corpus" / "b.jsonl").write_text('{"text": "some text here ok"}\n' * 20)


@pytest.mark.parametrize("files, outputs, named", INSIDE, ids=[c[1][:40] for c in INSIDE])
def test_outputs_inside_a_corpus_directory_or_glob_are_refused(tmp_path, capsys, monkeypatch,
                                                               files, outputs, named):
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    (tmp_path / "pipe.yaml").write_text(GOOD + CORPUS % files + outputs + "\n")
    before = sorted(p.name for p in (tmp_path / "corpus").rglob("*"))
    code, out, err = _in_process(capsys, "validate", "pipe.yaml")
    assert code == 1 and out == "", out + err
    assert err.startswith("pp-core: error: pipe.yaml") and "Traceback" not in err, err
    assert all(word in err for word in named), err
    assert sorted(p.name for p in (tmp_path / "corpus").rglob("*")) == before
    assert not (tmp_path / "cache").exists()


@pytest.mark.cli
@pytest.mark.ranks
def test_run_refuses_metrics_inside_the_corpus_before_any_rank_starts(tmp_path, capsys,
                                                                    monkeypatch):
    """The command in this process (cli.main): refused before any rank starts."""
    _corpus(tmp_path)
    (tmp_path / "pipe.yaml").write_text(GOOD + CORPUS % "corpus"
                                        + "output: {metrics: corpus/metrics.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "pipe.yaml"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out + err
    assert err == (  # both paths made absolute against the file's folder
        f"pp-core: error: pipe.yaml: output.metrics '{tmp_path}/corpus/metrics.jsonl' lies at "
        f"'metrics.jsonl' inside data.args.files '{tmp_path}/corpus', which this command reads: "
        f"writing there changes its input; choose another place\n")
    assert not (tmp_path / "corpus" / "metrics.jsonl").exists()


def test_outputs_beside_the_corpus_and_a_glob_that_misses_them_are_fine(tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    (tmp_path / "pipe.yaml").write_text(GOOD + CORPUS % "'corpus/*.txt'"
                                        + "output: {metrics: corpus/m.jsonl}\n")
    code, out, err = _in_process(capsys, "validate", "pipe.yaml")
    assert code == 0, err
