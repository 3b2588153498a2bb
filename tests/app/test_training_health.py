"""A run never trains on, or saves, non-finite numbers, and a resume refuses a checkpoint written
for another model or optimizer before any rank starts (issue #25, class 9). Real runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pp_core.app import cli
from pp_core.checkpoint.record import CHECKSUMS_FILE, RECORD_FILE
from tests.cases.specs import tiny_gpt_spec

ROOT = Path(__file__).resolve().parents[2]
ARGS = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
TINY = tiny_gpt_spec(model={"args": ARGS},
                     pipeline={"pp_batch_size": 2, "pp_microbatch_size": None},
                     distributed={"device": "cpu"}, train={"log_every": 1},
                     output={"progress": "plain"})
NAN_LOSS = """
import torch.nn.functional as F

def nan_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten()) * float("nan")
"""


def _run(tmp_path, values, *argv):
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "pp_core", "run", "pipe.yaml", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["stop"])  # skip: the same path with the update left out
def test_a_nan_loss_stops_the_run_or_skips_the_update(tmp_path, mode):
    (tmp_path / "nanloss.py").write_text(NAN_LOSS)
    values = {**TINY, "pipeline": {**TINY["pipeline"], "loss_fn": "nanloss:nan_loss"},
              "train": {**TINY["train"], "on_nonfinite": mode},
              "checkpoint": {"dir": "ckpt", "every": 1}}
    result = _run(tmp_path, values)
    text = result.stdout + result.stderr
    if mode == "stop":
        assert result.returncode == 1, text[-3000:]
        assert "step 1: the loss nan" in text and "training stopped before the update" in text
        assert "train.on_nonfinite: skip" in text
        assert not list((tmp_path / "ckpt").glob("step_*"))  # nothing saved
        # the stop is one error line, last, naming the rank, and no traceback (was a second
        # run of its own in test_round3_runs)
        lines = result.stderr.splitlines()
        assert lines[-1].startswith("pp-core: error: rank ") and "NonFiniteStep: step 1: the " \
            "loss nan and gradient norm nan is not finite; training stopped before the " \
            "update" in lines[-1], result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr
    else:
        assert result.returncode == 0, text[-3000:]
        assert "step 1: loss nan: this step's update is skipped" in text
        assert (tmp_path / "ckpt" / "step_00000002" / RECORD_FILE).is_file()


@pytest.mark.cli
@pytest.mark.ranks
def test_resume_refuses_another_model_or_optimizer_before_the_ranks_start(tmp_path, capsys,
                                                                          monkeypatch):
    values = {**TINY, "train": {**TINY["train"], "steps": 1}, "checkpoint": {"dir": "ckpt"}}
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(values))
    monkeypatch.chdir(tmp_path)
    # the checkpoint comes from the command in this process (its ranks forked warm): what is
    # checked is the validate that follows, not the run's own interpreter
    assert cli.main(["run", "pipe.yaml"]) == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()
    saved = tmp_path / "ckpt" / "step_00000001"
    resume = {**values, "checkpoint": {"dir": "ckpt", "resume": True},
              "train": {**TINY["train"], "steps": 2}}
    cases = [
        ({"model": {"name": "gpt", "args": {**ARGS, "num_layers": 2}}}, "model.args.num_layers"),
        ({"model": {"name": "gpt", "args": {**ARGS, "num_heads": 4}}}, "model.args.num_heads"),
        ({"train": {**resume["train"], "optimizer": {"name": "SGD", "lr": 0.1}}},
         "train.optimizer.name: checkpoint.resume"),
    ]
    for change, expected in cases:
        (tmp_path / "pipe.yaml").write_text(yaml.safe_dump({**resume, **change}))
        assert cli.main(["validate", "pipe.yaml"]) == 1
        err = capsys.readouterr().err
        assert expected in err, err
    (saved / RECORD_FILE).unlink()  # an older checkpoint: DCP's metadata still tells
    (saved / CHECKSUMS_FILE).unlink()  # (nor did an older pp-core record checksums)
    for change, expected in [
        ({"model": {"name": "gpt", "args": {**ARGS, "num_layers": 2}}},
         "parameter(s) this model lacks (layers.2."),
        ({"train": {**resume["train"], "optimizer": {"name": "SGD", "lr": 0.1,
                                                      "momentum": 0.9}}},
         "holds optimizer state ['exp_avg', 'exp_avg_sq', 'step'], but torch.optim.SGD keeps "
         "['momentum_buffer']"),
    ]:
        (tmp_path / "pipe.yaml").write_text(yaml.safe_dump({**resume, **change}))
        assert cli.main(["validate", "pipe.yaml"]) == 1
        err = capsys.readouterr().err
        assert expected in err, err
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(resume))
    assert cli.main(["validate", "pipe.yaml"]) == 0, capsys.readouterr().err
