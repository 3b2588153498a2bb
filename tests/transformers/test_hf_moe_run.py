"""A ``save_pretrained`` Qwen3-MoE through ``pp-core run`` (issue 32): loaded per stage
(transformers 5 saves the stacked experts as ``experts.<i>.gate_proj.weight`` ...), trained at
pp2 x dp2 x ep2 (4 gloo ranks), checkpointed, resumed at ep1 with the losses of the run that
never stopped, exported with ``--format hf`` into the names ``save_pretrained`` writes, and loaded
back by ``from_pretrained`` with the trained model's logits (fp32) - as the run's own
``checkpoint.export_hf`` (the stacked names the ranks hold) is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core.app import cli  # noqa: E402
from pp_core.checkpoint import checkpoint_path, read_model_state_dict  # noqa: E402
from tests.cases.hf_export import pretrained_logits, run_losses, run_losses_here  # noqa: E402
from tests.cases.hf_export import safetensors_keys  # noqa: E402

pytestmark = [pytest.mark.cli, pytest.mark.ranks, pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="HF experts are one stacked module from transformers 5 on, which expert "
           "parallelism shards (pp_core_builtins.transformers.experts); 4.x keeps a module each")]

SAVE_AT, STEPS = 2, 4
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
              num_experts_per_tok=2, head_dim=8, max_position_embeddings=32, norm_topk_prob=True)


def _spec(tmp: Path, name: str, distributed: dict, checkpoint: dict) -> dict:
    return {
        "model": {"name": "hf_causal_lm", "args": {"config": str(tmp / "source"),
                                                   "attn_implementation": "eager"}},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "dp_replicate": 2, "device": "cpu", **distributed},
        "train": {"steps": STEPS, "log_every": 1, "optimizer": {"name": "AdamW", "lr": 0.01}},
        "checkpoint": checkpoint,
        "output": {"progress": "off", "summary": False, "metrics": str(tmp / f"{name}.jsonl")}}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_moe")
    config = transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "source")
    losses = run_losses(tmp, _spec(tmp, "ep2", {"ep_size": 2},
                             {"dir": str(tmp / "ckpt"), "every": SAVE_AT,
                              "export_hf": str(tmp / "run_export")}))
    return {"tmp": tmp, "losses": losses, "source": tmp / "source",
            "saved": checkpoint_path(tmp / "ckpt", SAVE_AT),
            "checkpoint": checkpoint_path(tmp / "ckpt", STEPS)}


def test_a_per_expert_save_pretrained_directory_loads_as_from_pretrained_does(ep2):
    from pp_core_builtins.transformers.models import hf_causal_lm

    ours = hf_causal_lm(str(ep2["source"]), meta=False).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(ep2["source"]), local_files_only=True).state_dict()
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in safetensors_keys(ep2["source"])
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_an_ep2_run_resumes_at_ep1_with_the_uninterrupted_losses(ep2):
    """The ep 2 run is the command end to end; the resume goes through cli.main here."""
    tmp = ep2["tmp"]
    resumed = run_losses_here(tmp, _spec(tmp, "ep1", {"ep_size": 1},
                                   {"dir": str(tmp / "ckpt_ep1"),
                                    "resume": str(ep2["saved"])}))
    assert len(resumed) == STEPS - SAVE_AT
    assert resumed == pytest.approx(ep2["losses"][SAVE_AT:], rel=1e-5)


def test_an_ep2_checkpoint_exports_the_save_pretrained_names_and_logits(ep2, tmp_path):
    out = tmp_path / "export"
    assert cli.main(["export", str(ep2["checkpoint"]), "--format", "hf", "-o", str(out)]) == 0
    assert safetensors_keys(out) == safetensors_keys(ep2["source"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        str(ep2["source"]), attn_implementation="eager", local_files_only=True)
    trained.load_state_dict(read_model_state_dict(ep2["checkpoint"]), strict=True)
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = pretrained_logits(out, ids)
        torch.testing.assert_close(exported, trained(ids).logits, rtol=0, atol=1e-6)
        # the ranks' own export (checkpoint.export_hf) keeps the stacked experts the ranks hold
        torch.testing.assert_close(pretrained_logits(ep2["tmp"] / "run_export", ids), exported, rtol=0,
                                   atol=1e-6)
        assert not torch.allclose(pretrained_logits(ep2["source"], ids), exported, atol=1e-4)
