"""Checkpoints of expert-parallel runs (issue 32): ``moe_gpt`` at pp2 x dp2 x ep2 saves (each
expert weight whole in the file: one chunk per ep rank), resumes at ep1 with the losses of the
run that never stopped, and exports - from the checkpoint and from the ranks
(``checkpoint.export_hf``, the directory form of a model that is not an HF model) - the whole
expert tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pp_core.app import cli
from pp_core.checkpoint import SafeReader, checkpoint_path, read_model_state_dict
from tests.cases.specs import write_spec
from tests.cases.specs import tiny_gpt_spec

SAVE_AT, STEPS = 2, 4
MOE = tiny_gpt_spec(model={"name": "moe_gpt", "args": {"num_experts": 4, "top_k": 2,
                                                             "moe_hidden": 16}},
                    distributed={"dp_replicate": 2, "ep_size": 2, "device": "cpu"},
                    train={"steps": STEPS, "log_every": 1})


def _run(tmp: Path, name: str, **sections) -> dict[int, float]:
    metrics = tmp / f"{name}.jsonl"
    output = {**MOE["output"], "metrics": str(metrics)}
    spec = write_spec(tmp / f"{name}.yaml", MOE, output=output, **sections)
    # the command in this process (its ranks forked warm): test_moe_run runs moe_gpt at ep 2
    # as the command end to end
    assert cli.main(["run", str(spec)]) == 0
    return {row["step"]: row["loss"] for row in map(json.loads, metrics.read_text().splitlines())
            if "loss" in row}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ckpt")
    losses = _run(tmp, "ep2", checkpoint={"dir": str(tmp / "ckpt"), "every": SAVE_AT,
                                          "export_hf": str(tmp / "run_export")})
    return {"tmp": tmp, "losses": losses, "saved": checkpoint_path(tmp / "ckpt", SAVE_AT),
            "final": checkpoint_path(tmp / "ckpt", STEPS)}


@pytest.mark.cli
@pytest.mark.ranks
def test_an_ep2_checkpoint_holds_whole_experts_and_resumes_at_ep1(ep2):
    metadata = SafeReader(str(ep2["saved"])).read_metadata()
    stored = metadata.state_dict_metadata["model.layers.0.moe.experts.w1"]
    assert tuple(stored.size) == (4, 16, 16) and len(stored.chunks) == 2
    assert tuple(metadata.state_dict_metadata[
        "optim.state.layers.0.moe.experts.w1.exp_avg"].size) == (4, 16, 16)
    ep1 = _run(ep2["tmp"], "ep1", distributed={**MOE["distributed"], "ep_size": 1},
               checkpoint={"dir": str(ep2["tmp"] / "ckpt_ep1"), "resume": str(ep2["saved"])})
    assert sorted(ep1) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in ep1.items():
        assert loss == pytest.approx(ep2["losses"][step], rel=1e-5), (step, loss, ep2["losses"])


@pytest.mark.cli
@pytest.mark.ranks
def test_an_ep2_checkpoint_exports_whole_experts(ep2, tmp_path):
    state = read_model_state_dict(ep2["final"])
    assert state["layers.3.moe.experts.w2"].shape == (4, 16, 16)
    assert cli.main(["export", str(ep2["final"]), "--format", "safetensors", "-o",
                     str(tmp_path / "flat")]) == 0
    for directory in (tmp_path / "flat", ep2["tmp"] / "run_export"):
        exported = load_file(str(directory / "model.safetensors"))
        assert set(exported) == set(state)
        for name, value in state.items():
            assert torch.equal(exported[name], value), (directory, name)
        assert "name: moe_gpt" in (directory / "pp_core_model.yaml").read_text()
