"""Checkpoints: resume continues exactly, a pp=4 checkpoint loads at pp=2 and into the unsplit
model, ``pp-core export`` writes one state_dict, and loading never unpickles arbitrary objects."""

from __future__ import annotations

import enum
import io
import json
import os
import pathlib
import pickle
import shutil

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import (checkpoint_path, latest_checkpoint, load_checkpoint,
                                load_into_model, read_model_state_dict, save_checkpoint)
from pp_core.errors import PipelineError
from pp_core.app.spec import apply_overrides, parse_spec
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
BASE = tiny_gpt_spec(model={"args": MODEL}, distributed={"pp_size": 4, "device": "cpu"},
                     train={"steps": 4, "optimizer": {"name": "AdamW", "lr": 0.01},
                            "lr_decay": "linear"},
                     checkpoint={"every": 2})


def run(*overrides: str) -> list[float]:
    spec = parse_spec(apply_overrides(BASE, overrides), "ckpt.yaml")
    return warm_launch(spec)[0]["losses"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: pp=4 for 4 steps; B: pp=4 resumed from A's step 2; C: pp=2 resumed from A's step 2."""
    tmp = tmp_path_factory.mktemp("ckpt")
    a_dir, b_dir, c_dir = tmp / "a", tmp / "b", tmp / "c"
    a = run(f"checkpoint.dir={a_dir}", f"output.metrics={tmp / 'a.jsonl'}", "train.log_every=1")
    shutil.copytree(checkpoint_path(a_dir, 2), checkpoint_path(b_dir, 2))
    shutil.copy(tmp / "a.jsonl", tmp / "b.jsonl")  # B continues A's metrics file from step 2
    b = run(f"checkpoint.dir={b_dir}", "checkpoint.resume=true",  # picks b/step_2, the latest
            f"output.metrics={tmp / 'b.jsonl'}", "train.log_every=1")
    c = run("distributed.pp_size=2", f"checkpoint.dir={c_dir}",
            f"checkpoint.resume={checkpoint_path(a_dir, 2)}")
    return {"dirs": (a_dir, b_dir, c_dir), "losses": (a, b, c),
            "metrics": (tmp / "a.jsonl", tmp / "b.jsonl")}


@pytest.mark.ranks
def test_resume_continues_exactly(runs):
    a, b, _ = runs["losses"]
    assert len(a) == 4 and len(b) == 2
    assert b == a[2:]  # bit for bit: same weights, optimizer state, lr and batches
    a_dir, b_dir, _ = runs["dirs"]
    final_a = read_model_state_dict(checkpoint_path(a_dir, 4))
    final_b = read_model_state_dict(checkpoint_path(b_dir, 4))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


@pytest.mark.ranks
def test_a_resumed_run_writes_each_step_of_the_metrics_file_once(runs):
    a, b, _ = runs["losses"]
    a_lines, b_lines = (path.read_text().splitlines() for path in runs["metrics"])
    steps = [json.loads(line)["step"] for line in b_lines]
    assert steps == [1, 2, 3, 4]  # not 1, 2, 3, 4, 3, 4
    assert b_lines[:2] == a_lines[:2]  # the steps before the checkpoint are kept as written
    assert [json.loads(line)["loss"] for line in b_lines[2:]] == b


@pytest.mark.ranks
def test_a_pp4_checkpoint_loads_at_pp2(runs):
    a, _, c = runs["losses"]
    torch.testing.assert_close(torch.tensor(c), torch.tensor(a[2:]), rtol=1e-5, atol=1e-6)
    a_dir, _, c_dir = runs["dirs"]
    final_a = read_model_state_dict(checkpoint_path(a_dir, 4))
    final_c = read_model_state_dict(checkpoint_path(c_dir, 4))
    for name in final_a:
        torch.testing.assert_close(final_c[name], final_a[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.ranks
def test_a_pp4_checkpoint_loads_into_the_unsplit_model_and_exports(runs, tmp_path):
    a_dir = runs["dirs"][0]
    model = GPT(**MODEL)
    load_into_model(checkpoint_path(a_dir, 4), model)  # strict: every key, nothing extra
    state = read_model_state_dict(checkpoint_path(a_dir, 4))
    assert sorted(state) == sorted(model.state_dict())
    assert cli.main(["export", str(a_dir), "-o", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    assert cli.main(["export", str(checkpoint_path(a_dir, 4)), "-o",
                     str(tmp_path / "model.safetensors")]) == 0
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.ranks
def test_checkpoint_layout_and_latest(tmp_path, runs):
    a_dir = runs["dirs"][0]
    assert sorted(p.name for p in a_dir.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert (a_dir / "latest").read_text() == "step_00000004\n"
    assert latest_checkpoint(a_dir).name == "step_00000004"
    (tmp_path / "step_00000009").mkdir()  # no .metadata: an interrupted save is ignored
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_single_process_round_trip_and_mismatch(tmp_path):
    torch.manual_seed(0)
    model = GPT(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(32, (2, 8))).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 3, [model], [optimizer])
    other = GPT(**MODEL)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.5)
    assert load_checkpoint(path, [other], [other_optimizer]) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  other.state_dict().values()))
    assert other_optimizer.param_groups[0]["lr"] == 0.1
    bigger = GPT(**{**MODEL, "num_layers": 5})
    with pytest.raises(PipelineError, match=r"cannot load checkpoint .* into this pipeline"):
        load_checkpoint(path, [bigger], [torch.optim.AdamW(bigger.parameters())])


class _GetattrExploit:
    def __reduce__(self):
        return (getattr, (pathlib.Path, "write_text"))  # then a call could write any file

class _Python3112Pickler(pickle.Pickler):
    """Pickles enum members as Python 3.11.0 to 3.11.x do: ``getattr(cls, name)``."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_pickled_by_python_3_11_2_loads(tmp_path):
    """Debian 12's Python (3.11.2) pickles DCP's enum members through builtins.getattr; the safe
    reader admits that for enum members only, and not to reach anything else."""
    torch.manual_seed(0)
    model = GPT(**MODEL)
    path = save_checkpoint(tmp_path, 1, [model], [None])
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own file: trusted
    buffer = io.BytesIO()
    _Python3112Pickler(buffer).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    (path / ".metadata").write_bytes(buffer.getvalue())
    loaded = read_model_state_dict(path, verify=False)  # the checksum would refuse it first
    assert all(torch.equal(loaded[name], value) for name, value in model.state_dict().items())
    (path / ".metadata").write_bytes(pickle.dumps(_GetattrExploit()))
    with pytest.raises(PipelineError, match=r"calls getattr\(<class 'pathlib.Path'>, "
                                            r"'write_text'\); pp-core only admits it for a member"):
        read_model_state_dict(path, verify=False)

class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_loading_refuses_to_unpickle_arbitrary_objects(tmp_path):
    model = GPT(**MODEL)
    path = save_checkpoint(tmp_path, 1, [model], [None])
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(PipelineError, match=r"refers to posix.system; pp-core loads checkpoints "
                                            r"without unpickling arbitrary objects"):
        read_model_state_dict(path, verify=False)  # the unpickler, not the checksum, refuses
    with pytest.raises(PipelineError, match=r"not a complete checkpoint"):
        read_model_state_dict(tmp_path)
