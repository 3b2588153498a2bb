"""Checkpoints under faults: a rank killed while a checkpoint is overwritten, a save killed at
each instant of putting it in place, and checkpoints that are incomplete or corrupt.

The standard: the previous checkpoint survives any crash, ``latest`` always names a complete one,
a resumed run's losses are those of the run that was interrupted, and a damaged checkpoint is
refused with one line naming its directory (never an ``EOFError`` traceback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import (checkpoint_path, latest_checkpoint, read_model_state_dict,
                                save_checkpoint)
from pp_core.errors import PipelineError
from tests.cases.warm import warm_launch as launch
from pp_core.app.spec import apply_overrides, parse_spec
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
BASE = tiny_gpt_spec(model={"args": MODEL},
                     train={"steps": 4, "log_every": 1, "optimizer": {"name": "AdamW", "lr": 0.01}},
                     checkpoint={"every": 2})


class DiesWhileSaving(GPT):
    """The demo GPT, except that on rank 1 the process dies (``os._exit``) inside ``dcp.save``
    of step ``die_at_step``, right after writing its own shard and before the save completes."""

    def __init__(self, die_at_step: int = 0, **kwargs):
        super().__init__(**kwargs)
        if os.environ.get("RANK") == "1" and die_at_step:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            write_data = FileSystemWriter.write_data
            marker = f"step_{die_at_step:08d}"

            def dying_write_data(self, plan, planner):
                future = write_data(self, plan, planner)
                if marker in str(self.path):
                    future.wait()  # this rank's shard is on disk, the checkpoint is not whole
                    os._exit(9)
                return future

            FileSystemWriter.write_data = dying_write_data


def run(*overrides: str) -> list[float]:
    spec = parse_spec(apply_overrides(BASE, overrides), "faults.yaml")
    return launch(spec)[0]["losses"]


def logged(path: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, path.read_text().splitlines())}


@pytest.mark.ranks
def test_a_rank_killed_while_overwriting_a_checkpoint_loses_nothing(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    run(f"checkpoint.dir={ckpt}", "train.seed=1")  # an older run leaves step_2 and step_4
    older_step_4 = read_model_state_dict(checkpoint_path(ckpt, 4))

    # A new run in the same directory overwrites step_2, then rank 1 dies inside the save of
    # step_4 (its shard written, rank 0's too, no .metadata yet).
    target = {"target": f"{__name__}:DiesWhileSaving",
              "args": {**MODEL, "die_at_step": 4}}
    spec = parse_spec(apply_overrides({**BASE, "model": target}, (
        f"checkpoint.dir={ckpt}", "train.seed=2", f"output.metrics={metrics}")), "faults.yaml")
    with pytest.raises(PipelineError, match="rank 1 failed: the process exited with code 9"):
        launch(spec)
    interrupted = logged(metrics)
    assert sorted(interrupted) == [1, 2, 3, 4]  # it trained step 4 and died saving it

    # The older run's step_4 is intact; "latest" names the new run's step_2.
    survived = read_model_state_dict(checkpoint_path(ckpt, 4))
    assert all(torch.equal(survived[k], v) for k, v in older_step_4.items())
    assert latest_checkpoint(ckpt) == checkpoint_path(ckpt, 2)
    assert (ckpt / "latest").read_text() == "step_00000002\n"

    # Resuming continues the new run from its step 2 and reproduces its steps 3 and 4 exactly.
    resumed = run(f"checkpoint.dir={ckpt}", "train.seed=2", "checkpoint.resume=true",
                  f"output.metrics={metrics}")
    assert resumed == [interrupted[3], interrupted[4]]
    assert sorted(logged(metrics)) == [1, 2, 3, 4]
    # the new step_4 replaced the older run's, and the killed save left nothing behind
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    final = read_model_state_dict(checkpoint_path(ckpt, 4))
    assert not all(torch.equal(final[k], v) for k, v in older_step_4.items())


# A process that saves step 3 twice and is killed (os._exit) at one instant of putting the second
# save in place; ``os.rename``/``os.replace``/``shutil.rmtree`` are where those instants are.
_KILLED_SAVE = """
import os, shutil, sys, torch
from pp_core.checkpoint import save_checkpoint
from pp_core_builtins.models import GPT

directory, moment = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
save_checkpoint(directory, 3, [GPT(**{model})], [None])
real = {{"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}}

def dying(name, at):
    def call(*args, **kwargs):
        if at(*args):
            os._exit(9)
        return real[name](*args, **kwargs)
    return call

if moment == "before the new one is renamed in":
    os.rename = dying("rename", lambda src, dst: ".tmp-" in str(src))
elif moment == "before latest is updated":
    os.replace = dying("replace", lambda src, dst: str(dst).endswith("latest"))
elif moment == "while the old one is removed":
    os.rename, shutil.rmtree = real["rename"], dying("rmtree", lambda path, *a: True)
torch.manual_seed(1)
save_checkpoint(directory, 3, [GPT(**{model})], [None])
"""


@pytest.mark.cli
@pytest.mark.parametrize("moment", ["before the new one is renamed in",
                                    "before latest is updated", "while the old one is removed",
                                    "never"])
def test_a_save_killed_at_any_instant_leaves_a_complete_latest_checkpoint(tmp_path, moment):
    script = _KILLED_SAVE.format(model=MODEL)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), moment],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if moment == "never" else 9), done.stderr[-2000:]
    torch.manual_seed(0)
    old = GPT(**MODEL).state_dict()
    torch.manual_seed(1)
    new = GPT(**MODEL).state_dict()
    latest = latest_checkpoint(tmp_path)
    state = read_model_state_dict(latest)  # complete: loads without error
    expected = old if moment == "before the new one is renamed in" else new
    assert all(torch.equal(state[k], v) for k, v in expected.items()), (moment, latest)
    names = sorted(p.name for p in tmp_path.iterdir())
    if moment == "never":
        assert names == ["latest", "step_00000003"]


# ----------------------------------------------------------------------------- damaged checkpoints


def _damage(path: Path, how: str) -> None:
    shard = sorted(path.glob("*.distcp"))[0]
    if how == "truncated .metadata":
        (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:40])
    elif how == "empty .metadata":
        (path / ".metadata").write_bytes(b"")
    elif how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "no .metadata":
        (path / ".metadata").unlink()


DAMAGE = ["truncated .metadata", "empty .metadata", "missing shard", "truncated shard",
          "no .metadata"]


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "ckpt", 2, [GPT(**MODEL)], [None])


@pytest.mark.parametrize("how", DAMAGE)
def test_exporting_a_damaged_checkpoint_is_one_clear_error(saved, tmp_path, capsys, how):
    _damage(saved, how)
    for source in (saved, saved.parent):  # the step directory, or the checkpoint.dir
        assert cli.main(["export", str(source), "-o", str(tmp_path / "model.pt")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"pp-core: error: ") and err.count("\n") == 1, err
        assert str(source) in err and ("incomplete or corrupt" in err
                                      or "not a complete checkpoint" in err), err
    assert not (tmp_path / "model.pt").exists()


def test_exporting_a_path_that_is_not_a_checkpoint_is_one_clear_error(saved, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("hello")
    for bad, says in ((tmp_path / "missing", "does not exist"),
                      (tmp_path / "file.txt", "not a complete checkpoint")):
        assert cli.main(["export", str(bad), "-o", str(tmp_path / "model.pt")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(bad) in err and says in err, err
    assert cli.main(["export", str(saved), "-o", str(tmp_path / "file.txt" / "model.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create" in err, err
    assert "is a file, not a directory" in err, err


@pytest.mark.parametrize("how", ["truncated .metadata", "truncated shard"])
def test_resuming_from_a_damaged_checkpoint_fails_before_any_rank_starts(saved, tmp_path,
                                                                         capsys, how):
    _damage(saved, how)
    spec = tmp_path / "pipe.yaml"
    spec.write_text(json.dumps(BASE))
    for resume in ("true", str(saved)):
        code = cli.main(["run", str(spec), "--set", f"checkpoint.dir={saved.parent}",
                         "--set", f"checkpoint.resume={resume}"])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1, err
        assert f"checkpoint {str(saved)!r} is incomplete or corrupt" in err, err
