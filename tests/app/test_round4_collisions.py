"""One collision check for every writer (issue 48, class 1): ``checkpoint.export_hf`` is checked
with the other outputs of a run - against the pipeline file, the base model, the corpus, the token
cache, the checkpoint directory's own entries, the other outputs, and for a writable place - and
locked like them; ``schedule export FILE.yaml -o`` against what that file's run reads.
In-process commands; each refusal asserted whole (one line, no traceback)."""

from __future__ import annotations

import pytest

from pp_core.app import cli

GOOD = """\
model: {name: gpt, args: {dim: 16, num_layers: 2, num_heads: 2, max_seq_len: 8, vocab_size: 64}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 2}
train: {steps: 1}
"""
DATA = "data: {name: text_bytes, args: {seq_len: 8, path: corpus/a.txt}}\n"


def _setup(tmp):
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("some text " * 50)
    (tmp / "notes.txt").write_text("a file")
    (tmp / "ckpt" / "step_00000003").mkdir(parents=True)
    (tmp / "stuff").mkdir()
    for name in ("a.odt", "b.odt", "c.odt", "src/"):
        (tmp / "stuff" / name).mkdir() if name.endswith("/") else \
            (tmp / "stuff" / name).write_text("mine")


CASES = [  # (the checkpoint/output sections, the one line after "pp-core: error: pipe.yaml: ")
    ("checkpoint: {export_hf: pipe.yaml}",
     "checkpoint.export_hf '{t}/pipe.yaml' is the pipeline file, which this command reads: it "
     "would be overwritten; write checkpoint.export_hf somewhere else"),
    ("checkpoint: {export_hf: corpus}",
     "data.args.path 'corpus/a.txt' lies at 'a.txt' inside checkpoint.export_hf '{t}/corpus', "
     "which is replaced as a whole directory when it is written; put checkpoint.export_hf "
     "somewhere that holds neither"),
    ("checkpoint: {dir: ckpt, export_hf: ckpt/latest}",
     "checkpoint.export_hf '{t}/ckpt/latest' lies at 'latest' inside checkpoint.dir '{t}/ckpt', "
     "which a checkpoint save replaces or moves aside; put checkpoint.export_hf outside it (or "
     "elsewhere than step_*, latest, .latest.tmp-*)"),
    ("checkpoint: {dir: ckpt, export_hf: ckpt/step_00000003/hf}",
     "checkpoint.export_hf '{t}/ckpt/step_00000003/hf' lies at 'step_00000003' inside "
     "checkpoint.dir '{t}/ckpt', which a checkpoint save replaces or moves aside; put "
     "checkpoint.export_hf outside it (or elsewhere than step_*, latest, .latest.tmp-*)"),
    ("checkpoint: {export_hf: m.jsonl}\noutput: {metrics: m.jsonl}",
     "output.metrics and checkpoint.export_hf name the same path '{t}/m.jsonl': one would "
     "overwrite the other; give them different paths"),
    ("checkpoint: {export_hf: out}\noutput: {metrics: out/m.jsonl}",
     "output.metrics '{t}/out/m.jsonl' lies at 'm.jsonl' inside checkpoint.export_hf '{t}/out', "
     "which is replaced as a whole directory when it is written; put checkpoint.export_hf "
     "somewhere that holds neither"),
    ("checkpoint: {export_hf: notes.txt/hf}",
     "checkpoint.export_hf: cannot create '{t}/notes.txt/hf': '{t}/notes.txt' is a file, not a "
     "directory; choose another path"),
    ("checkpoint: {export_hf: /proc/hf}",
     "checkpoint.export_hf: cannot create '/proc/hf': '/proc' holds no files (a virtual file "
     "system); choose another place"),
    ("checkpoint: {export_hf: \"h\\0f\"}",
     "checkpoint.export_hf: 'h\\x00f' holds a NUL byte, which no file name can hold; remove it"),
    ("checkpoint: {export_hf: stuff}",
     "checkpoint.export_hf: '{t}/stuff' holds 4 entries no export writes ('a.odt', 'b.odt', "
     "'c.odt', ...); an export replaces the whole directory, so choose a new or empty "
     "directory, or an earlier export's"),
]


@pytest.mark.parametrize("extra, says", CASES, ids=[c[0][:48] for c in CASES])
def test_validate_refuses_an_export_hf_that_writes_over_what_the_run_uses(tmp_path, capsys,
                                                                          monkeypatch, extra,
                                                                          says):
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path)
    (tmp_path / "pipe.yaml").write_text(GOOD + DATA + extra + "\n")
    code = cli.main(["validate", "pipe.yaml"])
    out = capsys.readouterr()
    assert (code, out.out) == (1, ""), out.err
    assert out.err == f"pp-core: error: pipe.yaml: {says.format(t=tmp_path)}\n"
    assert (tmp_path / "corpus" / "a.txt").read_text().startswith("some text")


def test_schedule_export_refuses_writing_over_what_the_pipeline_files_run_reads(tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path)
    (tmp_path / "pipe.yaml").write_text(GOOD + DATA)
    for target, key in (("corpus/a.txt", "data.args.path"), ("pipe.yaml", "the pipeline file")):
        code = cli.main(["schedule", "export", "pipe.yaml", "-o", target])
        out = capsys.readouterr()
        assert (code, out.out) == (1, "")
        assert out.err == (f"pp-core: error: -o {target!r} is {key}, which this command reads: "
                           f"it would be overwritten; write -o somewhere else\n")
    assert (tmp_path / "corpus" / "a.txt").read_text().startswith("some text")


def test_the_one_writer_lock_covers_export_hf(tmp_path):
    from pp_core.app.commands.run_lock import lock_files
    from pp_core.app.spec import load_spec

    (tmp_path / "pipe.yaml").write_text(GOOD + DATA + "checkpoint: {dir: ckpt, export_hf: hf}\n")
    locks = dict(lock_files(load_spec(str(tmp_path / "pipe.yaml"))))
    assert locks["checkpoint.export_hf"] == tmp_path / ".hf.pp-core.lock"
    assert locks["checkpoint.dir"] == tmp_path / "ckpt" / ".pp-core.lock"
