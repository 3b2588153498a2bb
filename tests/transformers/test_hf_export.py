"""A ``save_pretrained`` model in, a ``from_pretrained`` directory out, at any layout (issue 32).

Two tiny Llamas made with ``save_pretrained`` here (tied and untied embeddings) train 4 steps
through ``pp-core run`` (4 gloo ranks): the tied one at pp2 x tp2, the untied one at
pp2 x dp_shard2, each with ``checkpoint.export_hf``. For each, ``pp-core export --format hf`` of
the DCP checkpoint writes the same bytes as the ranks' own export; the directory holds what
``save_pretrained`` writes (config with the dtype, generation config, the same tensor names, tied
weight stored once, the tokenizer) and ``AutoModelForCausalLM.from_pretrained`` gives the trained
model's logits exactly (fp32). The tied run's directory then starts a pp2 x tp1 run
(``model.args.config: DIR``) whose losses are those of the same layout resumed from the DCP
checkpoint (and of the trained weights stepping on in one process). Sharding by
``--max-shard-size`` gives HF's shard names and index; the directory form of a model that is not
an HF model holds the weights, an index and the YAML model section.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


from pp_core.app import cli  # noqa: E402
from pp_core.checkpoint import checkpoint_path, read_model_state_dict  # noqa: E402
from pp_core.checkpoint.record import RECORD_FILE  # noqa: E402
from tests.cases.hf_export import pretrained_logits, run_losses, run_losses_here  # noqa: E402
from tests.cases.hf_export import safetensors_keys  # noqa: E402

STEPS, LR = 4, 0.05
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _source(directory: Path, tied: bool) -> Path:
    config = transformers.AutoConfig.for_model("llama", tie_word_embeddings=tied, **CONFIG)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer = directory.parent / f"{directory.name}-tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": "1.0"}')  # copied, never parsed
    (tokenizer / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    return directory


def _spec(tmp: Path, source: Path, distributed: dict, **extra) -> dict:
    return {
        "model": {"name": "hf_causal_lm", "args": {"config": str(source),
                                                   "attn_implementation": "eager"}},
        "data": {"name": "synthetic", "args": {"seq_len": 8, "vocab_size": 64}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 2,
                     "loss_fn": "cross_entropy"},
        "distributed": {"pp_size": 2, "device": "cpu", **distributed},
        "train": {"steps": STEPS, "log_every": 1, "optimizer": {"name": "SGD", "lr": LR}},
        "checkpoint": {"dir": str(tmp / "ckpt"), "export_hf": str(tmp / "run_export")},
        "output": {"progress": "off", "summary": False, "metrics": str(tmp / "metrics.jsonl")},
        **extra}


def _trained(tmp_path_factory, name: str, tied: bool, distributed: dict, run=run_losses) -> dict:
    tmp = tmp_path_factory.mktemp(name)
    source = _source(tmp / "source", tied)
    run(tmp, _spec(tmp, source, distributed))
    step = checkpoint_path(tmp / "ckpt", STEPS)
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(tmp / "export")]) == 0
    return {"tmp": tmp, "source": source, "checkpoint": step, "export": tmp / "export",
            "run_export": tmp / "run_export", "tied": tied}


@pytest.fixture(scope="module")
def tp_tied(tmp_path_factory):
    return _trained(tmp_path_factory, "tp_tied", True, {"tp_size": 2})


@pytest.fixture(scope="module")
def fsdp_untied(tmp_path_factory):
    # through cli.main in this process (its ranks forked warm): the tied run and the run from
    # the exported directory are the command end to end, each in its own interpreter
    return _trained(tmp_path_factory, "fsdp_untied", False, {"dp_shard": 2}, run_losses_here)


def _dtype(config: dict) -> str:
    """The dtype a config.json records: ``dtype`` in transformers 5, ``torch_dtype`` in 4."""
    return config.get("dtype", config.get("torch_dtype"))


def _trained_logits(run: dict, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(run["source"]), attn_implementation="eager", local_files_only=True)
    model.load_state_dict(read_model_state_dict(run["checkpoint"]), strict=True)
    return model(ids).logits


@pytest.mark.cli
@pytest.mark.ranks
@pytest.mark.parametrize("which", ["tp_tied", "fsdp_untied"])
def test_export_is_a_save_pretrained_directory_with_the_trained_logits(which, request):
    run = request.getfixturevalue(which)
    export, source = run["export"], run["source"]
    assert sorted(p.name for p in export.iterdir()) == sorted(p.name for p in source.iterdir())
    assert safetensors_keys(export) == safetensors_keys(source)  # tied: lm_head.weight stored once, as HF does
    assert ("lm_head.weight" in safetensors_keys(export)) is not run["tied"]
    config, original = (json.loads((d / "config.json").read_text()) for d in (export, source))
    assert config == original and _dtype(config) == "float32"
    for name in ("config.json", "generation_config.json", "model.safetensors"):  # no gather
        assert (run["run_export"] / name).read_bytes() == (export / name).read_bytes(), name
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported, trained = pretrained_logits(export, ids), _trained_logits(run, ids)
        torch.testing.assert_close(exported, trained, rtol=0, atol=1e-6)
        assert not torch.allclose(pretrained_logits(source, ids), trained, atol=1e-4)  # it did train


@pytest.mark.cli
@pytest.mark.ranks
def test_shards_dtype_and_the_directory_form(tp_tied, tmp_path):
    out = tmp_path / "bf16"
    assert cli.main(["export", str(tp_tied["checkpoint"]), "--format", "hf", "--dtype",
                     "bfloat16", "--max-shard-size", "40KB", "-o", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["metadata"]["total_size"] == sum(
        2 * p.numel() for p in read_model_state_dict(tp_tied["checkpoint"]).values()) - 2 * 64 * 32
    assert _dtype(json.loads((out / "config.json").read_text())) == "bfloat16"
    major = int(transformers.__version__.split(".")[0])
    auto = {"dtype" if major >= 5 else "torch_dtype": "auto"}  # 4.x loads float32 by default
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                              **auto)
    assert model.dtype == torch.bfloat16
    edited = tmp_path / "edited"  # a copy: the other tests read the shared checkpoint
    shutil.copytree(tp_tied["checkpoint"], edited)
    record = edited / RECORD_FILE  # as a tokenized_text run of an earlier pp-core recorded it:
    values = json.loads(record.read_text())  # no "hf" description, the files read from there
    values["export"].pop("hf", None)
    values["export"]["data"] = {"name": "tokenized_text",
                                "args": {"tokenizer": str(tp_tied["tmp"] / "source-tokenizer")}}
    record.write_text(json.dumps(values))
    with_tokenizer = tmp_path / "with_tokenizer"
    assert cli.main(["export", str(edited), "--format", "hf", "--no-verify", "-o",
                     str(with_tokenizer)]) == 0  # the record was edited after its checksum
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (with_tokenizer / name).read_bytes() == \
            (tp_tied["tmp"] / "source-tokenizer" / name).read_bytes()
    flat = tmp_path / "flat"
    assert cli.main(["export", str(tp_tied["checkpoint"]), "--format", "safetensors", "-o",
                     str(flat)]) == 0
    assert "name: hf_causal_lm" in (flat / "pp_core_model.yaml").read_text()
    assert safetensors_keys(flat) == set(read_model_state_dict(tp_tied["checkpoint"]))


@pytest.mark.cli
@pytest.mark.ranks
def test_an_exported_directory_resumes_as_the_dcp_checkpoint_does(tp_tied):
    """pp2 x tp1 from ``model.args.config: DIR`` (on the batches the run would have seen next:
    ``data.args.start``) steps on with the losses of the same layout resumed from the DCP
    checkpoint, and both with those of the trained weights stepping on in one process. SGD
    without momentum: an HF directory carries no optimizer state, so only a stateless optimizer
    continues the same from both."""
    tmp = tp_tied["tmp"]
    from_dcp = _spec(tmp, tp_tied["source"], {"tp_size": 1})
    from_dcp["train"]["steps"] = STEPS + 2
    from_dcp["checkpoint"] = {"dir": str(tmp / "ckpt_resumed"),
                              "resume": str(tp_tied["checkpoint"])}
    from_dcp["output"]["metrics"] = str(tmp / "from_dcp.jsonl")
    from_export = _spec(tmp, tp_tied["export"], {"tp_size": 1})
    from_export["train"]["steps"] = 2
    from_export["data"]["args"]["start"] = STEPS
    from_export["checkpoint"] = {}
    from_export["output"]["metrics"] = str(tmp / "from_export.jsonl")
    resumed, started = run_losses_here(tmp, from_dcp), run_losses(tmp, from_export)
    assert len(started) == 2 and started == pytest.approx(resumed, rel=1e-6, abs=0)
    from pp_core_builtins.models.datasets import SyntheticLM

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tp_tied["source"]), attn_implementation="eager", local_files_only=True)
    model.load_state_dict(read_model_state_dict(tp_tied["checkpoint"]), strict=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = SyntheticLM(batch_size=4, seq_len=8, vocab_size=64)
    expected = []
    for index in range(STEPS, STEPS + 2):
        inputs, target = data.batch(index)
        loss = torch.nn.functional.cross_entropy(model(inputs).logits.reshape(-1, 64),
                                                 target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(float(loss.detach()))
    assert resumed == pytest.approx(expected, rel=1e-5)


def test_a_qwen3_moe_checkpoint_exports_as_save_pretrained_lays_it_out(tmp_path):
    """transformers 5 keeps MoE experts stacked in the model and ``save_pretrained`` writes them
    per expert (``experts.<i>.gate_proj.weight``): the export writes the same names, in the same
    shards (one checkpoint of the unsplit model, no run), and loads back to the same logits."""
    if not hasattr(transformers.modeling_utils, "revert_weight_conversion"):
        pytest.skip("transformers 4 saves MoE experts as the model holds them")
    from pp_core.checkpoint import save_checkpoint

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8,
        max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "reference", max_shard_size="30KB")
    step = save_checkpoint(tmp_path / "ckpt", 1, [model], [None], record={"export": {
        "model": {"name": "hf_causal_lm", "args": {"config": str(tmp_path / "reference")}}}})
    out = tmp_path / "export"
    assert cli.main(["export", str(step), "--format", "hf", "--max-shard-size", "30KB", "-o",
                     str(out)]) == 0
    index, reference = (json.loads((d / "model.safetensors.index.json").read_text())
                        for d in (out, tmp_path / "reference"))
    assert index == reference
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in index["weight_map"]
    ids = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pretrained_logits(out, ids), model(ids).logits, rtol=0, atol=1e-6)


def test_export_refusals_name_the_fix(tmp_path, capsys):
    from pp_core.checkpoint import save_checkpoint
    from tests.cases.runtime import gpt

    step = save_checkpoint(tmp_path / "ckpt", 1, [gpt(2)], [None],
                           record={"export": {"model": {"name": "gpt", "args": {}}}})
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(tmp_path / "hf")]) == 1
    assert "not a Hugging Face model" in capsys.readouterr().err
    assert cli.main(["export", str(step), "--format", "pt", "-o", str(tmp_path / "dir")]) == 1
    assert "--format pt writes a .pt file" in capsys.readouterr().err
    assert cli.main(["export", str(step), "--dtype", "int8", "-o", str(tmp_path / "d")]) == 1
    assert "--dtype 'int8': expected a floating dtype" in capsys.readouterr().err
    assert cli.main(["export", str(step), "--format", "safetensors", "--dtype", "float16",
                     "-o", str(tmp_path / "flat")]) == 0
    assert "name: gpt" in (tmp_path / "flat" / "pp_core_model.yaml").read_text()


def test_checkpoint_export_hf_is_checked_with_the_spec():
    from pp_core.app.spec import SpecError, parse_spec

    base = {"model": {"name": "gpt", "args": {}}, "data": {"name": "synthetic"}}
    spec = parse_spec({**base, "checkpoint": {"export_hf": {"dir": "runs/hf", "every": 5}}})
    assert spec.checkpoint.export_hf == {"dir": "runs/hf", "every": 5}
    assert parse_spec({**base, "checkpoint": {"export_hf": "runs/hf"}}).checkpoint.export_hf \
        == {"dir": "runs/hf", "every": None}
    for value, message in (({"dir": "runs/hf", "every": 0}, "with N a positive int"),
                           ("runs/a", "is checkpoint.dir too")):
        with pytest.raises(SpecError, match=message):
            parse_spec({**base, "checkpoint": {"dir": "runs/a", "export_hf": value}})
