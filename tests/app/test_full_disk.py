"""A full disk (issue #34, class 1): every writer says so in one line naming its key and path,
removes what it had started and leaves what was there intact. The metrics and the trace of a run
end, the training does not; a checkpoint save is removed and the last good one stays; an export
leaves no partial file. Real runs on a real full disk: a small tmpfs mounted here, or
``RLIMIT_FSIZE`` in the run's process where nothing can be mounted."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import save_checkpoint
from pp_core_builtins.models import GPT

from tests.cases.cli import PP_CORE
from tests.cases.disks import fill, small_disk

MODEL = {"vocab_size": 64, "dim": 32, "num_layers": 2, "num_heads": 2, "max_seq_len": 8}
PIPE = f"""\
model: {{name: gpt, args: {json.dumps(MODEL)}}}
data: {{name: synthetic, args: {{seq_len: 8, vocab_size: 64}}}}
pipeline: {{pp_batch_size: 2, loss_fn: cross_entropy}}
distributed: {{pp_size: 2}}
train: {{steps: 30, log_every: 1, optimizer: {{name: AdamW, lr: 0.01}}}}
output: {{progress: off, summary: false}}
"""
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _run(tmp: Path, *overrides, limit: int | None = None):
    def limited():  # RLIMIT_FSIZE: a write past `limit` bytes fails with EFBIG, not a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.run([PP_CORE, "run", "pipe.yaml", *sets], cwd=tmp, env=ENV, text=True,
                          capture_output=True, timeout=400,
                          preexec_fn=limited if limit else None)


def _warnings(stderr: str) -> list[str]:
    """The write-failure lines (a loaded machine adds slow-step warnings, which are no concern)."""
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    return [line for line in stderr.splitlines() if "cannot write" in line]


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("disk", ["tmpfs", "RLIMIT_FSIZE"])
def test_a_full_metrics_disk_ends_the_metrics_and_trace_not_the_training(tmp_path, disk):
    (tmp_path / "pipe.yaml").write_text(PIPE)
    if disk == "tmpfs":
        with small_disk(tmp_path / "full", 256 << 10) as full:
            fill(full, leave=3 * 4096)  # a page per lock file, one for about 12 lines
            done = _run(tmp_path, f"output.metrics={full}/m.jsonl",
                        f"output.trace={full}/trace.json", "checkpoint.dir=ckpt")
            lines = (full / "m.jsonl").read_text().splitlines()
            left = sorted(p.name for p in full.iterdir())
        reason, path = "no space left on the device", f"{full}/m.jsonl"
        fix = "free some space or choose another place"
    else:
        done = _run(tmp_path, "output.metrics=m.jsonl", "output.summary=true", limit=3000)
        lines = (tmp_path / "m.jsonl").read_text().splitlines()
        left = [".filler", "m.jsonl"]
        reason, path = "the file grew past the size this process may write", str(tmp_path / "m.jsonl")
        fix = "free some space or choose another place"
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert (tmp_path / "ckpt" / "step_00000030").is_dir() or \
        "  steps 1..30 in " in done.stdout  # trained to the end
    records = [json.loads(line) for line in lines]  # every line whole
    assert 3 <= len(records) < 30 and [r["step"] for r in records] == list(
        range(1, len(records) + 1))
    warned = _warnings(done.stderr)
    assert warned[0] == (f"pp-core rank 0: WARNING: pp_core.app.rank.output_files: output.metrics: "
                         f"cannot write {path!r}: {reason}; it keeps the lines before step "
                         f"{len(records) + 1} and gets no more; training goes on; {fix}")
    if disk == "tmpfs":
        assert warned[1:] == [f"pp-core rank 0: WARNING: pp_core.app.rank.output_files: "
                              f"output.trace: cannot write '{full}/trace.json': {reason}; it was "
                              f"not written; the run's result is unaffected; {fix}"]
        assert left == [".filler", "m.jsonl"]  # no trace, no temporary file, no lock left
    else:
        assert len(warned) == 1


def _checkpoint_bytes() -> int:
    """What one checkpoint of MODEL with AdamW state takes on a tmpfs (whole pages per file)."""
    import tempfile

    torch.manual_seed(0)
    model = GPT(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as scratch:
        path = save_checkpoint(scratch, 1, [model], [optimizer])
        return sum(-(-p.stat().st_size // 4096) * 4096 for p in path.iterdir())


@pytest.mark.cli
@pytest.mark.ranks
def test_a_checkpoint_the_disk_refuses_is_removed_and_the_last_good_one_stays(tmp_path):
    (tmp_path / "pipe.yaml").write_text(PIPE)
    size = _checkpoint_bytes()
    with small_disk(tmp_path / "full", 4 << 20) as full:
        fill(full, leave=size * 3 // 2 + 3 * 4096)  # one checkpoint fits, not two
        done = _run(tmp_path, f"checkpoint.dir={full}/ckpt", "checkpoint.every=1",
                    "train.steps=3")
        left = sorted(p.name for p in (full / "ckpt").iterdir())
        exported = cli.main(["export", f"{full}/ckpt", "-o", str(tmp_path / "model.pt")])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("pp-core: error: rank ") and (
        f"checkpoint.dir: cannot write '{full}/ckpt/step_00000002': no space left on the "
        f"device; the partial save was removed and the last good checkpoint "
        f"'{full}/ckpt/step_00000001' is intact; free some space or choose another place"
        in done.stderr), done.stderr
    assert left == ["latest", "step_00000001"]  # no step_N.tmp-*, no lock
    assert exported == 0  # whole, checksums and all


def test_an_export_onto_a_full_disk_leaves_no_partial_file_and_the_old_one(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", 1, [GPT(**MODEL)], [None])
    with small_disk(tmp_path / "full", 1 << 20) as full:
        (full / "model.pt").write_bytes(b"an earlier export")
        fill(full, leave=8192)
        for name in ("model.pt", "model.safetensors"):
            code = cli.main(["export", "ckpt", "-o", str(full / name)])
            out = capsys.readouterr()
            assert code == 1 and out.out == "", out.out + out.err
            assert out.err == (f"pp-core: error: -o: cannot write '{full}/{name}': no space "
                               f"left on the device; nothing was written; free some space or "
                               f"choose another place\n")
        assert sorted(p.name for p in full.iterdir()) == [".filler", "model.pt"]
        assert (full / "model.pt").read_bytes() == b"an earlier export"


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no traceback
def test_tensorboard_on_a_full_disk_stops_with_one_warning_not_an_error(tmp_path, caplog):
    import logging

    pytest.importorskip("tensorboard")
    from pp_core.app.rank.data_metrics import TensorBoardSink

    with small_disk(tmp_path / "full", 256 << 10) as full:
        sink = TensorBoardSink(str(full / "tb"))
        fill(full)
        with caplog.at_level(logging.WARNING):
            for step in range(1, 200):  # enough figures to need a page the disk has not
                sink.pp_report_metrics(step, {"loss": 1.0 / step, "lr": 0.01, "tag": "x" * 64})
            sink.close()
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"output.tensorboard: cannot write '{full}/tb': no space left on the "
                      f"device; TensorBoard gets no more figures this run; training goes on; "
                      f"free some space or choose another place"], warned


def test_a_short_write_in_torchs_zip_writer_is_a_full_disk():
    """DCP's shard writer on a full disk sometimes fails inside torch's zip writer with no
    errno (where the last write fell decides); it is the same refused write, said the same
    way. Other runtime errors are not disk errors."""
    import errno

    from pp_core.write_failures import disk_error

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = RuntimeError("the save failed")
    wrapped.__cause__ = short
    assert disk_error(wrapped).errno == errno.ENOSPC
    assert disk_error(RuntimeError("unexpected pos in a tensor of mine")) is None
