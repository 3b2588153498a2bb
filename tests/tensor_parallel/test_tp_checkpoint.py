"""Checkpoints of tensor-parallel parts (DCP) move between layouts (issue 22).

Saved at pp2 x tp2 (4 gloo ranks, real files; DTensor weights and AdamW moments, the fused
``qkv`` a ``_StridedShard``), a checkpoint resumes at pp2 x tp1 and in the unsplit model on one
process with the weights and moments the sharded run held, bit for bit, and the losses of the run
that never stopped (1e-5 relative); it exports to the unsplit model's ``state_dict`` exactly.
"""

from __future__ import annotations

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import checkpoint_path, read_model_state_dict
from tests.cases.dcp import check_resumed, merged, resume_unsplit
from tests.cases.runtime import gpt
from tests.cases.tp_ckpt import resume, train_and_save

SAVE_AT, STEPS = 2, 4
RTOL = 1e-5


pytestmark = pytest.mark.ranks(4, timeout=180)


@pytest.fixture(scope="module")
def sharded(pool, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_ckpt")
    results = pool.run(train_and_save, str(directory), SAVE_AT, STEPS)
    placements = {p for r in results for p in r["placements"].values()}
    return {**merged(results), "path": checkpoint_path(directory, SAVE_AT),
            "placements": placements}


def _check(results, sharded):
    losses = torch.tensor(sharded["losses"][SAVE_AT:])
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), losses, rtol=RTOL, atol=0)
    check_resumed(results, sharded, SAVE_AT, atol=RTOL * float(losses.abs().max()))


def test_tp_checkpoint_resumes_at_pp2_tp1(pool, sharded):
    assert any("_StridedShard" in p for p in sharded["placements"]), sharded["placements"]
    assert any("Shard(dim=1)" in p for p in sharded["placements"]), sharded["placements"]
    _check(pool.run(resume, str(sharded["path"]), STEPS), sharded)


def test_tp_checkpoint_resumes_in_the_unsplit_model(sharded):
    _check([resume_unsplit(str(sharded["path"]), STEPS)], sharded)


def test_tp_checkpoint_exports_the_unsplit_state_dict(sharded, tmp_path):
    state = read_model_state_dict(sharded["path"])
    model = gpt(4)
    assert set(state) == set(model.state_dict())
    for name, value in state.items():
        assert value.shape == model.state_dict()[name].shape, name
        if name in sharded["saved"]:
            assert torch.equal(value, sharded["saved"][name]), name
    model.load_state_dict(state, strict=True)
    output = tmp_path / "model.pt"
    assert cli.main(["export", str(sharded["path"]), "-o", str(output)]) == 0
    exported = torch.load(output, weights_only=True)
    assert set(exported) == set(state)
    assert all(torch.equal(exported[k], state[k]) for k in state)
