"""A command's own ``-o`` is checked before any work, in one line (issue #48, item 4): ``plan -o``
onto a directory, under a regular file, into ``/proc``, onto the corpus or the pipeline file it
plans (it used to measure for a minute, then overwrite the corpus or end in IsADirectoryError);
``export -o FILE/sub`` and ``-o /proc/x`` (raw tracebacks). In-process, real files."""

from __future__ import annotations

import time

import pytest
import torch
import yaml

from pp_core.app import cli
from pp_core.checkpoint import save_checkpoint
from pp_core_builtins.models import GPT

MODEL = {"vocab_size": 256, "dim": 8, "num_layers": 2, "num_heads": 2, "max_seq_len": 8}
PIPE = {
    "model": {"name": "gpt", "args": MODEL},
    "data": {"name": "tokenized_text", "args": {"files": "corpus.txt", "tokenizer": "bytes",
                                                "seq_len": 8, "cache_dir": "cache"}},
    "pipeline": {"pp_schedule": "auto", "pp_batch_size": 4, "loss_fn": "cross_entropy"},
    "distributed": {"pp_size": 2, "device": "cpu"},
    "train": {"steps": 1},
    "output": {"progress": "off", "summary": False},
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("a few words of text\n\n" * 40)
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(PIPE))
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "a_dir").mkdir()
    return tmp_path


def _refused(capsys, argv) -> str:
    started = time.perf_counter()
    code = cli.main(argv)
    out = capsys.readouterr()
    assert code == 1 and out.out == "", out.out + out.err
    assert time.perf_counter() - started < 20  # refused, nothing measured (was 40 s and more)
    return out.err


PLAN_OUTPUTS = [
    ("a_dir", "pp-core: error: -o: 'a_dir' is a directory, expected a file; choose another "
              "path\n"),
    ("a_file/chosen.yaml", "pp-core: error: -o: cannot create 'a_file/chosen.yaml': "
                           "'{folder}/a_file' is a file, not a directory; choose another path\n"),
    ("/proc/chosen.yaml", "pp-core: error: -o: cannot create '/proc/chosen.yaml': '/proc' holds "
                          "no files (a virtual file system); choose another place\n"),
    ("corpus.txt", "pp-core: error: -o 'corpus.txt' is data.args.files, which this command "
                   "reads: it would be overwritten; write -o somewhere else\n"),
    ("./pipe.yaml", "pp-core: error: -o './pipe.yaml' is the pipeline file, which this "
                    "command reads: it would be overwritten; write -o somewhere else\n"),
]


@pytest.mark.parametrize("output, message", PLAN_OUTPUTS, ids=[o for o, _ in PLAN_OUTPUTS])
def test_plan_checks_its_output_before_measuring(folder, capsys, output, message):
    corpus = (folder / "corpus.txt").read_text()
    assert _refused(capsys, ["plan", "pipe.yaml", "--no-link", "-o", output]) == \
        message.replace("{folder}", str(folder))
    assert (folder / "corpus.txt").read_text() == corpus
    assert not (folder / "cache").exists()  # the corpus was not even tokenized


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    save_checkpoint(root / "ckpt", 2, [GPT(**MODEL)], [None])
    (root / "a_file").write_text("not a directory")
    return root


EXPORT_OUTPUTS = [
    ("a_file/model.pt", "pp-core: error: -o: cannot create 'a_file/model.pt': '{folder}/a_file' "
                        "is a file, not a directory; choose another path\n"),
    ("a_file/sub", "pp-core: error: -o: cannot create 'a_file/sub': '{folder}/a_file' is a file, "
                   "not a directory; choose another path\n"),
    ("/proc/x", "pp-core: error: -o: cannot create '/proc/x': '/proc' holds no files (a virtual "
                "file system); choose another place\n"),
]


@pytest.mark.parametrize("output, message", EXPORT_OUTPUTS, ids=[o for o, _ in EXPORT_OUTPUTS])
@pytest.mark.parametrize("fmt", [[], ["--format", "hf"]], ids=["pt", "hf"])
def test_export_checks_its_output_in_one_line(checkpoint, capsys, monkeypatch, output, message,
                                             fmt):
    monkeypatch.chdir(checkpoint)
    assert _refused(capsys, ["export", "ckpt", *fmt, "-o", output]) == \
        message.replace("{folder}", str(checkpoint))


def test_plan_writes_what_differs_with_paths_for_where_it_writes(tmp_path, monkeypatch):
    """``plan -o`` (issue #49, item 6): the file it writes reads the same inputs from its own
    folder, holds only what differs from the defaults, and sends its outputs beside the source
    run's, not over them; it used to copy 110 lines of defaults and the source's output paths."""
    from pp_core.app.commands.plan import written_file
    from pp_core.app.spec import load_spec

    source = tmp_path / "a"
    source.mkdir()
    (source / "corpus.txt").write_text("text\n\n" * 40)
    (source / "pipe.yaml").write_text(yaml.safe_dump({
        **PIPE, "checkpoint": {"dir": "runs/ckpt", "export_hf": "runs/hf"},
        "output": {"metrics": "runs/metrics.jsonl", "progress": "off"}}))
    monkeypatch.chdir(tmp_path)
    spec = load_spec("a/pipe.yaml")
    values = spec.to_dict()
    values["pipeline"].update(pp_schedule="dfs", pp_microbatch_size=2)  # as written_spec plans
    written, moved = written_file(spec, values, "b/chosen.yaml")
    assert written == {
        "model": {"name": "gpt", "args": MODEL},
        "data": {"name": "tokenized_text",
                 "args": {**PIPE["data"]["args"], "files": "../a/corpus.txt",
                          "cache_dir": "../a/cache"}},
        "pipeline": {"pp_schedule": "dfs", "pp_batch_size": 4, "pp_microbatch_size": 2,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "device": "cpu"},
        "train": {"steps": 1},
        "checkpoint": {"dir": "../a/runs/chosen/ckpt", "export_hf": "../a/runs/chosen/hf"},
        "output": {"metrics": "../a/runs/chosen/metrics.jsonl", "progress": "off"}}
    assert moved == ["checkpoint.dir", "checkpoint.export_hf", "output.metrics"]
