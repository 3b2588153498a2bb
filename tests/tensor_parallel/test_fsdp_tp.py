"""FSDP2 x TP inside a pipeline (issue 22): 8 gloo ranks, pp2 x dp_shard2 x tp2 on one mesh, the
demo GPT; loss and every gradient of one step equal to the unsplit model on one process (1e-5
relative) for 1f1b, zero_bubble (split backward) and v_schedule (two stages per rank); and a DCP
checkpoint of those parts (the fused ``qkv`` a tp strided shard sharded again over dp) reloads
every shard bit for bit, loads at pp2 x tp2 without FSDP and exports the unsplit ``state_dict``.
One process group for the module: 8 ranks on 2 cores are the suite's dearest."""

import pytest
import torch

from pp_core.checkpoint import checkpoint_path, read_model_state_dict
from tests.cases.fsdp_tp import fsdp_tp_checkpoint, fsdp_tp_matrix, sgd_reference
from tests.cases.runtime import gpt

RTOL = 1e-5
SCHEDULES = ["1f1b", "zero_bubble", "v_schedule"]


pytestmark = pytest.mark.ranks(8, timeout=300)


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(fsdp_tp_matrix, SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp_dp_shard_tp_equals_one_process(results, schedule):
    ranks = [r[schedule] for r in results]
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    # the last stage's 4 ranks (2 dp x 2 tp) each return the mean loss of their dp rank's batch
    assert len(losses) == 4, losses
    ref = ranks[0]["ref_loss"]
    assert abs(sum(losses) / 4 - ref) <= RTOL * abs(ref), (losses, ref)
    for rank, result in enumerate(ranks):
        assert result["grad_err"] <= RTOL, (rank, result["grad_err"])
        assert result["modules"] > 0 and result["units"] > 0, "nothing was sharded"
    assert len({n for r in ranks for n in r["names"]}) == 4 * 8 + 5  # every parameter covered
    placements = {p for r in ranks for p in r["placements"]}
    assert any("_StridedShard" in p and "Shard(dim=1)" not in p for p in placements), placements
    assert all(p.count(",") >= 1 for p in placements), placements  # 2-D: (dp_shard, tp)


@pytest.fixture(scope="module")
def checkpoint(pool, tmp_path_factory):
    """Saved at pp2 x dp_shard2 x tp2, reloaded there and at pp2 x tp2 (see fsdp_tp_checkpoint)."""
    directory = tmp_path_factory.mktemp("fsdp_tp_ckpt")
    return directory, pool.run(fsdp_tp_checkpoint, str(directory))


def test_fsdp_tp_checkpoint_reloads_every_shard_bit_for_bit(checkpoint):
    for rank, result in enumerate(checkpoint[1]):
        assert set(result["reloaded"]) == set(result["saved"]), rank
        for name, value in result["saved"].items():
            assert torch.equal(result["reloaded"][name], value), (rank, name)


def test_fsdp_tp_checkpoint_loads_without_fsdp_and_exports_the_unsplit_state_dict(checkpoint):
    directory, results = checkpoint
    want = sgd_reference()  # the unsplit model after the same step: weights and momenta
    loaded = {name: value for r in results for name, value in r["loaded"].items()}
    assert set(loaded) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value, rtol=RTOL, atol=RTOL, msg=name)
    exported = read_model_state_dict(checkpoint_path(directory, 1))
    assert set(exported) == set(gpt(4).state_dict())
    for name, value in exported.items():
        assert torch.equal(value, loaded[name]), name  # the file holds what pp2 x tp2 loaded
