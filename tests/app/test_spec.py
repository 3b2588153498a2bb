"""The YAML spec: every kind of mistake is refused before any process starts, with the key path,
what was expected, what was found and the closest valid key; ``--set`` overrides; examples."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from pp_core.app import cli
from pp_core.app.factories import dataset_args, dataset_factory
from pp_core.app.check import preflight
from pp_core.app.spec import (SCHEMA, Spec, SpecError, apply_overrides, load_spec, parse_override,
                              parse_spec)
from pp_core.config import PipelineConfig
from tests.cases.specs import tiny_gpt_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

BASE = tiny_gpt_spec(model={"args": {"vocab_size": None, "dim": 32, "num_heads": 4,
                                              "max_seq_len": 16}},
                     data={"args": {"seq_len": 16, "vocab_size": None}}, train={"steps": 3},
                     output=None)


def spec_with(*overrides: str):
    return parse_spec(apply_overrides(BASE, overrides), "pipe.yaml")


def problems_of(*overrides: str, plugins: bool = False) -> list[str]:
    with pytest.raises(SpecError) as info:
        spec = spec_with(*overrides)
        if plugins:
            preflight(spec)
    return info.value.problems


def test_a_good_spec_fills_every_default():
    spec = spec_with()
    for section, keys in SCHEMA.items():
        assert set(spec.to_dict()[section]) == {k.name for k in keys}
    assert spec.train.optimizer == {"name": "AdamW", "lr": 1e-3}
    assert spec.distributed.master_addr == "127.0.0.1"
    assert spec.pipeline.num_microbatches == 4
    assert spec.world_size == 2 and spec.global_batch_size == 4


def test_the_spec_is_typed_and_frozen():
    spec = spec_with("model.args.dim=64", "train.steps=5")
    assert spec.train.steps == 5 and spec.model.args["dim"] == 64
    with pytest.raises(AttributeError):
        spec.train.stpes
    with pytest.raises(AttributeError):
        spec.trian
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train.steps = 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.train = spec.train
    assert isinstance(spec.pipeline, PipelineConfig) and spec.pipeline is spec.pipeline
    assert spec.pipeline.pp_batch_size == 4
    changed = spec.with_("train", steps=9)
    assert (changed.train.steps, spec.train.steps) == (9, 5) and changed.model is spec.model


def test_to_dict_and_from_dict_give_back_the_same_spec():
    spec = spec_with("pipeline.module_fqns_per_model_part=[[a, b], [c]]",
                     "pipeline.pp_schedule=gpipe", "checkpoint.dir=ck", "checkpoint.resume=true")
    values = spec.to_dict()
    assert yaml.safe_load(yaml.safe_dump(values)) == values  # plain data, as in a file
    again = Spec.from_dict(values, spec.source)
    assert again == spec and again.to_dict() == values and again.source == "pipe.yaml"
    values["model"]["args"]["dim"] = 1  # a copy: the spec keeps its own values
    assert spec.model.args["dim"] == 32 and again.model.args["dim"] == 32
    planned = dataclasses.replace(spec, prediction={"schedule": "gpipe"})
    assert Spec.from_dict(planned.to_dict(), "x.yaml").prediction == {"schedule": "gpipe"}


def test_unknown_section_and_key_name_the_closest_valid_one():
    found = problems_of("trian.steps=3", "train.stpes=3", "pipeline.pp_shedule=gpipe")
    assert any(p.startswith("trian: unknown section; did you mean 'train'?") for p in found)
    assert any(p.startswith("train.stpes: unknown key; did you mean 'train.steps'?")
               for p in found)
    assert any("pipeline.pp_shedule: unknown key; did you mean 'pipeline.pp_schedule'?" in p
               for p in found)


def test_wrong_types_say_expected_and_found():
    found = problems_of("train.steps=ten", "train.log_every=0", "distributed.backend=mpi",
                        "output.summary=maybe", "train.grad_clip=[1]", "pipeline.pp_batch_size=1.5")
    assert "train.steps: expected a positive int, found 'ten' (str)" in found
    assert "train.log_every: expected a positive int, found 0 (int)" in found
    assert any(p.startswith("distributed.backend: expected one of 'auto', 'gloo', 'nccl'")
               and "found 'mpi' (str)" in p for p in found)
    assert "output.summary: expected true or false, found 'maybe' (str)" in found
    assert any(p.startswith("train.grad_clip: expected a finite number") for p in found)
    assert "pipeline.pp_batch_size: expected a positive int, found 1.5 (float)" in found


def test_a_choice_typo_is_guessed():
    found = problems_of("train.lr_decay=cosin")
    assert any("(did you mean 'cosine'?)" in p for p in found)


def test_all_mistakes_are_reported_at_once():
    with pytest.raises(SpecError) as info:
        spec_with("train.steps=0", "train.seeed=1", "output.trace=3")
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems in pipe.yaml:\n  - ")


def test_missing_sections_and_keys():
    with pytest.raises(SpecError) as info:
        parse_spec({"data": {"args": {}}}, "pipe.yaml")
    text = str(info.value)
    assert "model: missing section" in text
    assert "data.name: missing; expected a dataset registered by a plugin" in text


@pytest.mark.parametrize("overrides, expected", [
    (("model.target=pp_core_builtins.models.gpt:GPT",), "expected exactly one of model.name"),
    (("model.name=null",), "found neither"),
    (("checkpoint.every=5",), "checkpoint.every: needs checkpoint.dir"),
    (("checkpoint.resume=true",), "checkpoint.resume: needs checkpoint.dir"),
    (("distributed.nnodes=3",), "cannot be shared evenly by nnodes=3"),
    (("distributed.nnodes=2",), "distributed.master_port: expected a port every node can reach"),
    (("distributed.nnodes=2", "distributed.nproc_per_node=2", "distributed.master_port=1"),
     "expected nnodes * nproc_per_node = pp_size * dp_size = 2, found 2 * 2"),
    (("distributed.nnodes=2", "distributed.master_port=1", "distributed.rdzv_backend=static"),
     "distributed.node_rank: expected this machine's index"),
    (("distributed.backend=nccl", "distributed.device=cpu"), "found 'nccl' (nccl needs CUDA"),
    (("pipeline.pp_batch_size=6", "pipeline.pp_microbatch_size=4"),
     "pipeline.pp_batch_size: pp_batch_size=6 is not divisible by pp_microbatch_size=4"),
    (("pipeline.loss_fn=cross_entropi",), "pipeline.loss_fn: unknown loss 'cross_entropi'; did "
                                          "you mean 'cross_entropy'?"),
    # the key comes from the error (ConfigError.field), not from the first field its text names
    (("pipeline.loss_fn=pp_seq_len",), "pipeline.loss_fn: unknown loss 'pp_seq_len'"),
    (("pipeline.dtype=pp_batch_size",), "pipeline.dtype: dtype='pp_batch_size' is not a torch"),
    (("train.optimizer={name: adamw}",), "did you mean 'AdamW'?"),
    (("train.optimizer={name: SGD, lr: 0.1, momentun: 0.9}",),
     "train.optimizer.momentun: unknown argument of torch.optim.SGD; did you mean "
     "'train.optimizer.momentum'?"),
])
def test_impossible_combinations(overrides, expected):
    found = problems_of(*overrides)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("overrides, expected", [
    (("model.name=gtp",), "model.name: unknown model 'gtp'; did you mean 'gpt'? installed models:"),
    (("model.args.dimm=3",), "model.args.dimm: unknown argument of GPT; did you mean "
                             "'model.args.dim'?"),
    (("data.name=text_byte",), "data.name: unknown dataset 'text_byte'; did you mean 'text_bytes'?"),
    (("data.args.batch_size=3",), "data.args.batch_size: expected pipeline.pp_batch_size * "
                                  "distributed.dp_size = 4 * 1 = 4"),
    (("pipeline.loss_fn=null",), "pipeline.loss_fn: expected a loss for the last stage"),
    (("pipeline.pp_schedule=1f1c",), "pipeline.pp_schedule: unknown schedule '1f1c'"),
    (("pipeline.pp_schedule=dualpipe_v", "pipeline.pp_batch_size=2"), "microbatches = "
                                                                     "pp_batch_size / pp_microbatch_size = 2"),
    (("distributed.pp_size=8",), "pipeline: cannot split the model: model has 4 layers"),
    (("model.target=pp_core_builtins.models.gpt:GTP", "model.name=null"), "model.target: model.target="),
])
def test_plugin_checks_name_the_key(overrides, expected):
    found = problems_of(*overrides, plugins=True)
    assert any(expected in p for p in found), found


def test_preflight_plans_the_split_and_schedule():
    found = preflight(spec_with("pipeline.pp_schedule=interleaved_1f1b"))
    assert found.plan.num_stages == 4 and found.plan.splitter == "layers"
    assert found.schedule.num_ranks == 2 and found.schedule.num_stages == 4


def test_dataset_gets_the_global_batch_size():
    spec = spec_with("distributed.dp_size=2")
    factory = dataset_factory(spec)
    assert dataset_args(spec, factory)["batch_size"] == 8
    inputs, target = next(iter(factory(**dataset_args(spec, factory))))
    assert inputs.shape == target.shape == (8, 16)


def test_override_parsing():
    assert parse_override("train.steps=10") == (["train", "steps"], 10)
    assert parse_override("train.optimizer.betas=[0.9, 0.95]")[1] == [0.9, 0.95]
    assert parse_override("model.name=gpt")[1] == "gpt"
    assert parse_override("checkpoint.dir=")[1] is None
    with pytest.raises(SpecError, match=r"expected key.path=value"):
        parse_override("train.steps")
    with pytest.raises(SpecError, match=r"not valid YAML"):
        parse_override("train.steps=[1")


def test_overrides_create_and_replace(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    spec = load_spec(path, ["train.steps=7", "data.args.seq_len=8", "output.metrics=m.jsonl",
                            "train.optimizer.lr=1e-2"])
    assert spec.train.steps == 7 and spec.data.args["seq_len"] == 8
    assert spec.output.metrics == str(tmp_path / "m.jsonl")  # beside the file, absolute
    assert spec.train.optimizer["lr"] == 0.01  # YAML reads 1e-2 as a string; coerced
    with pytest.raises(SpecError, match=r"train.steps is 3 \(int\), not a mapping"):
        load_spec(path, ["train.steps.x=1"])
    with pytest.raises(SpecError, match=r"train.stesp: unknown key; did you mean 'train.steps'"):
        load_spec(path, ["train.stesp=1"])


def test_checkpoint_dir_null_turns_a_files_checkpoints_off():
    """docs/yaml.md's own example, ``--set checkpoint.dir=null``, on the demo (which saves every
    250 steps): no checkpoints, no error. ``every`` with no ``dir`` at all is still refused."""
    spec = load_spec(ROOT / "examples" / "demo.yaml", ["checkpoint.dir=null"])
    assert spec.checkpoint.dir is None  # train() saves nothing without a dir
    assert "--set checkpoint.dir=null" in (ROOT / "docs" / "yaml.md").read_text()
    assert problems_of("checkpoint.every=5") == [
        "checkpoint.every: needs checkpoint.dir, found checkpoint.dir unset; add checkpoint.dir: "
        "<path>"]
    assert problems_of("checkpoint.dir=null", "checkpoint.resume=true") == [
        "checkpoint.resume: needs checkpoint.dir, found checkpoint.dir unset; add "
        "checkpoint.dir: <path>"]

def test_pp_schedule_null_with_a_csv_validates_and_without_one_is_named(tmp_path):
    csv = tmp_path / "order.csv"
    cli.main(["schedule", "export", "gpipe", "--pp", "2", "-m", "4", "-o", str(csv)])
    spec = spec_with("pipeline.pp_schedule=null", f"pipeline.pp_schedule_csv={csv}")
    checked = preflight(spec)
    assert spec.pipeline.pp_schedule is None
    assert checked.schedule.num_stages == 2 and checked.plan.num_stages == 2
    assert problems_of("pipeline.pp_schedule=null") == [
        "pipeline.pp_schedule: pp_schedule=None needs pp_schedule_csv: set one of the two, a "
        "schedule name such as pp_schedule='1f1b' or a compute-only CSV file as pp_schedule_csv"]

def test_file_errors(tmp_path):
    with pytest.raises(SpecError, match=r"no such file"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match=r"not valid YAML"):
        load_spec(bad)
    bad.write_text("- a list\n")
    with pytest.raises(SpecError, match=r"expected a mapping with sections model, data"):
        load_spec(bad)
    bad.write_text("!!python/object/apply:os.system ['echo unsafe']\n")
    with pytest.raises(SpecError, match=r"not valid YAML"):  # safe_load builds no objects
        load_spec(bad)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates(path):
    found = preflight(load_spec(path))
    assert found.schedule is not None and found.plan is not None


def test_validate_command(tmp_path, capsys):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "splitter 'layers'" in out and "schedule 1f1b" in out
    assert cli.main(["validate", str(path), "--set", "train.stpes=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pp-core: error: ") and "did you mean 'train.steps'" in err
    assert cli.main(["run", str(path), "--set", "distributed.pp_size=0"]) == 1
    assert "distributed.pp_size: expected a positive int, found 0" in capsys.readouterr().err


def test_docs_document_every_key_with_its_default():
    text = (ROOT / "docs" / "yaml.md").read_text()
    for section, keys in SCHEMA.items():
        assert re.search(rf"^## `{section}`", text, re.M), f"docs/yaml.md lacks ## `{section}`"
        for key in keys:
            row = re.search(rf"^\| `{section}\.{key.name}` \|[^\n]*", text, re.M)
            assert row, f"docs/yaml.md has no table row for {section}.{key.name}"
            default = "required" if key.required else "—" if key.default is None else \
                "`" + yaml.safe_dump(key.default, default_flow_style=True, sort_keys=False) \
                .strip().removesuffix("...").strip() + "`"
            assert f"| {default} |" in row.group(0), \
                f"docs/yaml.md: {section}.{key.name} should show default {default!r}"
