"""Checkpoints of FSDP2-sharded parts (DCP) move between layouts like any other checkpoint.

Saved at pp2 x fsdp2 (4 gloo ranks, real files), a checkpoint loads at pp4 unsharded, at pp1 x
fsdp4, at pp1 x HSDP 2 x 2, into the unsplit model on one process, and exports to one safetensors
file: the weights and AdamW moments loaded are the whole ones the sharded run held, and training
on from them gives the losses of the run that never stopped (1e-5). The same through ``pp-core run``'s YAML path
(``checkpoint.resume`` at another ``distributed`` layout).
"""

from __future__ import annotations

import pytest
import torch

from pp_core.app import cli
from pp_core.checkpoint import checkpoint_path
from pp_core.app.spec import apply_overrides, parse_spec
from tests.cases.dcp import check_resumed, merged, resume, resume_unsplit, train_and_save
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

SAVE_AT, STEPS = 3, 5
ATOL = 1e-5


pytestmark = pytest.mark.ranks(4, timeout=180)


@pytest.fixture(scope="module")
def sharded(pool, tmp_path_factory):
    """pp2 x fsdp2 for STEPS steps, checkpoint after SAVE_AT: losses, the path, what it held."""
    directory = tmp_path_factory.mktemp("fsdp_ckpt")
    results = pool.run(train_and_save, str(directory), (2, 1, 2), SAVE_AT, STEPS)
    return {**merged(results), "path": checkpoint_path(directory, SAVE_AT)}


@pytest.mark.parametrize("layout", [(4, 1, 1), (1, 1, 4), (1, 2, 2)],
                         ids=["pp4", "pp1xfsdp4", "pp1xhsdp2x2"])
def test_sharded_checkpoint_resumes_at_another_layout(pool, sharded, layout):
    check_resumed(pool.run(resume, str(sharded["path"]), layout, STEPS), sharded, SAVE_AT)


def test_sharded_checkpoint_resumes_in_the_unsplit_model(sharded):
    check_resumed([resume_unsplit(str(sharded["path"]), STEPS)], sharded, SAVE_AT)


def test_sharded_checkpoint_exports_the_whole_weights(sharded, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    output = tmp_path / "model.safetensors"
    assert cli.main(["export", str(sharded["path"]), "-o", str(output)]) == 0
    exported = load_file(str(output))
    weights = {k: v for k, v in sharded["saved"].items() if not k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert set(exported) >= set(weights)
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name


MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
YAML = tiny_gpt_spec(model={"args": MODEL}, data={"args": {"seed": 3}},
                     distributed={"dp_shard": 2, "device": "cpu"},
                     # grad_clip below the norm: each layout clips with its own (DTensor or plain) norm
                     train={"steps": 4, "seed": 7, "grad_clip": 0.3,
                            "optimizer": {"name": "AdamW", "lr": 0.01}},
                     checkpoint={"every": 2})


def test_yaml_resume_of_a_sharded_checkpoint_at_pp4(tmp_path):
    """``pp-core run`` at pp2 x dp_shard 2 saves; resumed with ``checkpoint.resume`` at pp4
    (global batch unchanged) it continues with the losses of the uninterrupted run."""
    def run(*overrides):
        spec = parse_spec(apply_overrides(YAML, overrides), "fsdp_ckpt.yaml")
        return warm_launch(spec)[0]["losses"]

    first = run(f"checkpoint.dir={tmp_path / 'a'}")
    resumed = run("distributed.pp_size=4", "distributed.dp_shard=1", "pipeline.pp_batch_size=8",
                  f"checkpoint.dir={tmp_path / 'b'}",
                  f"checkpoint.resume={checkpoint_path(tmp_path / 'a', 2)}")
    assert len(first) == 4 and len(resumed) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(first[2:]), rtol=0, atol=ATOL)
