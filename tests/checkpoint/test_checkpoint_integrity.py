"""No corrupted checkpoint is trusted (issue #34, class 2): every file carries the checksum recorded
when it was written, checked at resume (validate, run), load and export; a malformed record is
refused naming it (and so is an older pp-core's identity file). Real checkpoints on disk,
damaged the way a disk or a hand does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import load_into_model, save_checkpoint
from pp_core.app.check.resume import run_identity
from pp_core.checkpoint.record import CHECKSUMS_FILE, RECORD_FILE, SECTIONS
from pp_core.checkpoint.safe_reader import SafeReader
from pp_core.app.spec import load_spec
from pp_core.errors import PipelineError
from pp_core_builtins.models import GPT


MODEL = {"vocab_size": 256, "dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 8}
PIPE = f"""\
model: {{name: gpt, args: {json.dumps(MODEL)}}}
data: {{name: synthetic, args: {{seq_len: 8, vocab_size: 256}}}}
pipeline: {{pp_batch_size: 2, loss_fn: cross_entropy}}
distributed: {{pp_size: 2}}
train: {{steps: 3}}
checkpoint: {{dir: ckpt, resume: true}}
output: {{progress: off, summary: false}}
"""


def _zero_4k(path: Path) -> None:
    """4 KiB zeroed inside the largest tensor's bytes (the embedding): same size, other data."""
    infos = SafeReader(str(path)).read_metadata().storage_data.values()
    largest = max((i for i in infos if str(i.relative_path) == "__0_0.distcp"),
                  key=lambda i: i.length)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = largest.offset + largest.length // 2
    data[middle - 2048: middle + 2048] = bytes(4096)
    shard.write_bytes(bytes(data))


def _flip_metadata(path: Path) -> None:
    data = bytearray((path / ".metadata").read_bytes())
    data[-3] ^= 1
    (path / ".metadata").write_bytes(bytes(data))


def _edit_record(path: Path) -> None:  # valid JSON, other content: only the checksum knows
    text = (path / RECORD_FILE).read_text().replace('"num_heads": 2', '"num_heads": 4')
    (path / RECORD_FILE).write_text(text)


def _drop_checksums(path: Path) -> None:
    (path / CHECKSUMS_FILE).unlink()


def _garble_checksums(path: Path) -> None:
    (path / CHECKSUMS_FILE).write_text('{"algorithm": "sha256", "files": ')


DAMAGE = [  # (how, the damage, what the one line must say)
    ("4 KiB zeroed in a shard", _zero_4k, "its file __0_0.distcp does not match the sha256"),
    ("a .metadata bit flipped", _flip_metadata, "its file .metadata does not match"),
    ("the record edited", _edit_record, f"its file {RECORD_FILE} does not match"),
    ("the checksums file removed", _drop_checksums,
     f"its {CHECKSUMS_FILE} is missing (its {RECORD_FILE} says one was written)"),
    ("the checksums file truncated", _garble_checksums, f"its {CHECKSUMS_FILE} cannot be read"),
]


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PP_CORE_VERIFIED_CHECKPOINTS", raising=False)
    (tmp_path / "pipe.yaml").write_text(PIPE)
    spec = load_spec("pipe.yaml")
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "ckpt", 2, [GPT(**MODEL)], [None],
                           record={"run": run_identity(spec)})


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("how, damage, says", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_checkpoint_is_refused_by_validate_export_and_load(saved, capsys, how, damage,
                                                                     says):
    code, out, err = _cli(capsys, "validate", "pipe.yaml")
    assert code == 0, err  # intact: resumes
    damage(saved)
    where = f"step_00000002' is incomplete or corrupt: {says}"
    code, out, err = _cli(capsys, "validate", "pipe.yaml")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("pp-core: error: pipe.yaml: checkpoint.resume: ") and where in err, err
    assert f"checkpoint '{saved.parent}/" in err, err  # the file's paths, made absolute
    code, out, err = _cli(capsys, "export", "ckpt", "-o", "model.pt")
    assert "checkpoint 'ckpt/" in err, err  # a command-line path, as given
    assert (code, out) == (1, "") and err == f"pp-core: error: {err[16:]}" and where in err, err
    assert err.count("\n") == 1 and not Path("model.pt").exists()
    with pytest.raises(PipelineError, match="incomplete or corrupt"):
        load_into_model(saved, GPT(**MODEL))


def test_verify_false_reads_a_checkpoint_whose_bytes_changed(saved, capsys):
    _zero_4k(saved)
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "checkpoint.verify=false")
    assert code == 0, err
    code, out, err = _cli(capsys, "export", "ckpt", "-o", "model.pt", "--no-verify")
    assert code == 0 and Path("model.pt").is_file(), err


def test_an_intact_checkpoint_lists_every_file_it_holds(saved):
    listed = json.loads((saved / CHECKSUMS_FILE).read_text())
    on_disk = {p.name for p in saved.iterdir()} - {CHECKSUMS_FILE}
    assert listed["algorithm"] == "sha256" and set(listed["files"]) == on_disk
    identity = json.loads((saved / RECORD_FILE).read_text())["run"]
    assert {k: identity["layout"][k] for k in ("pp_size", "dp_replicate", "dp_shard", "tp_size",
                                               "ep_size")} == {"pp_size": 2, "dp_replicate": 1,
                                                               "dp_shard": 1, "tp_size": 1,
                                                               "ep_size": 1}


MALFORMED = [  # (the record's text, what the line names) - with verify off, the record speaks
    ('{"version": 1, "run": {"model": {"name": "gpt", "args": {"dim": 16', "JSONDecodeError"),
    ("", "JSONDecodeError"),
    ('"gpt"', "a JSON object expected"),
    ('{"run": "gpt"}', "its 'run' section: a JSON object expected"),
    ('{"run": {"model": "gpt"}}', "'model' is not an object"),
    ('{"run": {"model": {"name": 3}}}', "'model.name' / 'model.target' are not strings"),
    ('{"run": {"model": {"name": "gpt", "args": {}}, "optimizer": ["AdamW"]}}', "'optimizer'"),
    ('{"run": {"model": {"name": "gpt", "args": {}}, "layout": {"tp_size": "2"}}}',
     "integer degrees"),
    (b"\xff\xfe{}", "UnicodeDecodeError"),
]


@pytest.mark.parametrize("text, says", MALFORMED, ids=[str(m[0])[:30] for m in MALFORMED])
def test_a_malformed_record_is_refused_naming_it(saved, capsys, text, says):
    (saved / RECORD_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "checkpoint.verify=false")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert f"checkpoint.resume: '{saved / RECORD_FILE}' is malformed (" in err, err
    assert says in err, err
    assert "Traceback" not in err and "AttributeError" not in err


def test_an_older_checkpoint_is_read_from_its_own_files_and_refused_when_malformed(saved, capsys):
    """An earlier pp-core kept the run in ``pp_core_run.json`` and promised the checksums there:
    it resumes, its missing list is refused, and a malformed file is refused naming it."""
    record = json.loads((saved / RECORD_FILE).read_text())
    (saved / RECORD_FILE).unlink()
    older = saved / SECTIONS["run"]
    older.write_text(json.dumps({**record["run"], "checksums": CHECKSUMS_FILE}))
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "checkpoint.verify=false")
    assert code == 0, err
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "model.args.num_heads=4",
                          "--set", "checkpoint.verify=false")
    assert code == 1 and "model.args.num_heads: checkpoint.resume: " in err, err
    _drop_checksums(saved)
    code, out, err = _cli(capsys, "export", "ckpt", "-o", "model.pt")
    assert code == 1 and f"its {CHECKSUMS_FILE} is missing (its {older.name} says" in err, err
    older.write_text('{"model": "gpt"}')
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "checkpoint.verify=false")
    assert code == 1 and err.count("\n") == 1, err
    assert f"checkpoint.resume: '{saved / older.name}' is malformed (" in err, err  # made absolute


def test_a_truncated_record_no_longer_lets_a_head_count_change_resume(saved, capsys):
    file = saved / RECORD_FILE
    file.write_text(file.read_text()[:40])
    code, out, err = _cli(capsys, "validate", "pipe.yaml", "--set", "model.args.num_heads=4",
                          "--set", "checkpoint.verify=false")
    assert code == 1 and "is malformed" in err, err


@pytest.mark.cli
@pytest.mark.ranks
def test_run_refuses_to_resume_a_zeroed_shard_before_any_rank_starts(saved, capsys, monkeypatch):
    """The command in this process (cli.main): refused before any rank starts."""
    _zero_4k(saved)
    monkeypatch.chdir(saved.parents[1])
    capsys.readouterr()
    code = cli.main(["run", "pipe.yaml"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out + err
    assert err == (
        f"pp-core: error: pipe.yaml: checkpoint.resume: checkpoint '{saved}' is incomplete "
        f"or corrupt: its file __0_0.distcp does not match the sha256 checksum recorded when it "
        f"was written (its bytes changed since); resume or export from another step_NNNNNNNN "
        f"directory, or delete this one (checkpoint.verify: false, or export --no-verify, skips "
        f"this check)\n")
