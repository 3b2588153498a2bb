"""The token cache trusts none of its own files (issue #34, classes 1 and 2): each is checked
against the checksum recorded when it was written, and any change (an overwritten tokens.bin, a
replaced offsets.npy, a truncated file, a garbled meta.json) is tokenized again - or, where the
cache cannot be replaced, refused naming the directory to delete. A build the disk refuses leaves
no staging directory; validate writes nothing. Real files, a real full (tmpfs) disk."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pp_core.app import cli
from pp_core.errors import PipelineError
from pp_core_builtins.models.tokenized import tokenized_text

from tests.cases.disks import fill, remount, small_disk

TEXT = "\n\n".join(f"document {i}: " + "some words that repeat, " * (i % 5 + 1)
                   for i in range(60))


def _make(root: Path, cache: Path):
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TEXT)
    return tokenized_text(files=[str(corpus)], tokenizer="bytes", seq_len=16, batch_size=4,
                          cache_dir=str(cache))


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    return entry


def _overwrite_tokens(entry: Path) -> None:  # what the issue did: every id 65, same size
    size = (entry / "tokens.bin").stat().st_size
    np.full(size // 4, 65, dtype=np.uint32).tofile(entry / "tokens.bin")


def _replace_offsets(entry: Path) -> None:  # a smaller, valid index renamed over it
    np.save(entry / "other.npy", np.load(entry / "offsets.npy")[:5])
    os.replace(entry / "other.npy", entry / "offsets.npy")


def _truncate_tokens(entry: Path) -> None:
    data = (entry / "tokens.bin").read_bytes()
    (entry / "tokens.bin").write_bytes(data[: len(data) // 2])


def _touch_only(entry: Path) -> None:  # touched, not changed: kept after its sha256 matches
    os.utime(entry / "tokens.bin", ns=(1, 1))


def _overwrite_in_place_keeping_the_stamp(entry: Path) -> None:
    """Issue #48, item 3: the same inode, size and modification time, other tokens (the cache
    used to re-hash a file only when that stamp changed)."""
    path = entry / "tokens.bin"
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.write(np.full(8, 65, dtype=np.uint32).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)


def _garble_meta(entry: Path) -> None:
    (entry / "meta.json").write_text('{"num_docs": ')


DAMAGE = [  # (how, damage, the warning names, rebuilt?)
    ("tokens.bin overwritten with 65s", _overwrite_tokens, "tokens.bin does not match", True),
    ("tokens.bin overwritten in place, stamp kept", _overwrite_in_place_keeping_the_stamp,
     "tokens.bin does not match", True),
    ("offsets.npy replaced", _replace_offsets, "offsets.npy holds", True),
    ("tokens.bin truncated", _truncate_tokens, "tokens.bin holds", True),
    ("meta.json garbled", _garble_meta, "meta.json cannot be read", True),
    ("offsets.npy removed", lambda e: (e / "offsets.npy").unlink(), "offsets.npy is missing",
     True),
    ("tokens.bin only touched", _touch_only, None, False),
]


@pytest.mark.parametrize("how, damage, says, rebuilt", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_changed_cache_file_is_found_and_tokenized_again(tmp_path, caplog, how, damage, says,
                                                           rebuilt):
    first = _make(tmp_path, tmp_path / "cache")
    expected = [first.batch(i) for i in range(3)]
    entry = _entry(tmp_path / "cache")
    damage(entry)
    with caplog.at_level(logging.WARNING):
        again = _make(tmp_path, tmp_path / "cache")
    warned = [r.getMessage() for r in caplog.records if "token cache" in r.getMessage()]
    if rebuilt:
        assert len(warned) == 1 and str(entry) in warned[0] and says in warned[0], warned
    else:
        assert warned == []
    for index, (inputs, target) in enumerate(expected):
        got_inputs, got_target = again.batch(index)
        assert torch.equal(got_inputs["input_ids"], inputs["input_ids"]) and \
            torch.equal(got_target, target)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == \
        sorted([entry.name, f"{entry.name}.lock"])  # nothing aside, no staging left


def test_a_damaged_cache_that_cannot_be_replaced_names_the_directory_to_delete(tmp_path):
    with small_disk(tmp_path / "disk", 4 << 20) as disk:
        _make(tmp_path, disk / "cache")
        entry = _entry(disk / "cache")
        _overwrite_tokens(entry)
        remount(disk, read_only=True)
        with pytest.raises(PipelineError) as refused:
            _make(tmp_path, disk / "cache")
    assert str(refused.value) == (
        f"data.args.cache_dir: the token cache {str(entry)!r} is damaged (tokens.bin does not "
        f"match the sha256 checksum recorded when it was written) and cannot be replaced here "
        f"(Read-only file system); delete {str(entry)!r} and run again")


def test_a_full_disk_fails_the_build_in_one_line_and_leaves_no_staging(tmp_path):
    with small_disk(tmp_path / "disk", 64 << 10) as disk:
        fill(disk, leave=2048)
        for _ in range(2):  # a second try leaves nothing either
            with pytest.raises(PipelineError) as refused:
                _make(tmp_path, disk / "cache")
            message = str(refused.value)
            assert message.startswith("data.args.cache_dir: cannot write the token cache ") and \
                "no space left on device; nothing was left behind" in message, message
            assert [p.name for p in (disk / "cache").iterdir() if not p.name.endswith(".lock")] \
                == []


PIPE = """\
model: {name: gpt, args: {dim: 16, num_layers: 2, num_heads: 2, max_seq_len: 16, vocab_size: 256}}
data: {name: tokenized_text, args: {files: corpus.txt, tokenizer: bytes, seq_len: 16,
                                    cache_dir: cache}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 2}
train: {steps: 1}
"""


def test_validate_writes_no_cache_and_reads_a_built_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "pipe.yaml").write_text(PIPE)
    assert cli.main(["validate", "pipe.yaml"]) == 0, capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
    _make(tmp_path, tmp_path / "cache")
    entry = _entry(tmp_path / "cache")
    before = {p.name: p.stat().st_mtime_ns for p in entry.iterdir()}
    _overwrite_tokens(entry)
    damaged = (entry / "tokens.bin").read_bytes()
    assert cli.main(["validate", "pipe.yaml"]) == 0, capsys.readouterr().err
    assert (entry / "tokens.bin").read_bytes() == damaged  # left for the run to rebuild
    assert set(before) == {p.name for p in entry.iterdir()}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == \
        sorted([entry.name, f"{entry.name}.lock"])
    shutil.rmtree(tmp_path / "cache")
