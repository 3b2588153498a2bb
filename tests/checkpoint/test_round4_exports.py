"""What is exported is what was trained, and no export writes over what it reads (issue 48,
classes 1-3). A tiny Llama made with ``save_pretrained`` here, a checkpoint of it saved in this
process with the record a run writes; every command runs in-process (``cli.main``), every refusal
is asserted whole (one line, no traceback).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core.app import cli  # noqa: E402
from pp_core.app.check.resume import check_resume_identity, run_identity  # noqa: E402
from pp_core.app.export.hf import export_record  # noqa: E402
from pp_core.app.spec import load_spec  # noqa: E402
from pp_core.checkpoint import save_checkpoint  # noqa: E402
from pp_core.checkpoint.record import CHECKSUMS_FILE, RECORD_FILE, SECTIONS  # noqa: E402
from pp_core_builtins.models import GPT  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
              rms_norm_eps=1e-6)
PIPE = """\
model: {name: hf_causal_lm, args: {config: base, attn_implementation: eager}%s}
data: {name: tokenized_text, args: {files: [corpus.txt], tokenizer: tok, seq_len: 8}}
pipeline: {pp_batch_size: 2, loss_fn: cross_entropy}
distributed: {pp_size: 1}
train: {steps: 1}
checkpoint: {dir: ckpt}
"""
EXPORTED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"]


def _cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _save(tmp: Path, pipe: str, model, name: str = "pipe"):
    (tmp / f"{name}.yaml").write_text(pipe)
    spec = load_spec(str(tmp / f"{name}.yaml"))
    return save_checkpoint(tmp / ("ckpt" if name == "pipe" else f"ckpt-{name}"), 1, [model],
                           [None], record={"run": run_identity(spec), "export": export_record(spec)})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base directory, a tokenizer, a corpus, and a checkpoint of the base, weights changed."""
    tmp = tmp_path_factory.mktemp("round4")
    config = transformers.AutoConfig.for_model("llama", **CONFIG)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp / "base")
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp / "tok" / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (tmp / "corpus.txt").write_text("some training text\n")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.25)  # trained: not the base's weights
    return {"tmp": tmp, "step": _save(tmp, PIPE % "", model), "model": model}


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(directory.glob("*.safetensors"))}


def test_a_lora_runs_export_hf_writes_the_adapter_pp_core_export_writes(trained, tmp_path,
                                                                        capsys):
    """``checkpoint.export_hf`` of a ``model.lora`` run (the ranks' export, here one gloo rank)
    writes the PEFT adapter ``pp-core export`` writes of the same weights, which PEFT loads."""
    peft = pytest.importorskip("peft")
    import torch.distributed as dist

    from pp_core.app.adapters import apply_adapters
    from pp_core.app.export.run import export_from_run

    tmp = trained["tmp"]
    settings = {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"],
                "init_lora_weights": False}
    base = lambda: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        tmp / "base", local_files_only=True, attn_implementation="eager")
    torch.manual_seed(2)
    model = apply_adapters(base(), settings, None)
    step = _save(tmp, PIPE % ", lora: {r: 2, alpha: 4, target_modules: [q_proj, v_proj], "
                 "init_lora_weights: false}", model, "lora")
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        export_from_run(load_spec(str(tmp / "lora.yaml")), [model], tmp_path / "run")
    finally:
        dist.destroy_process_group()
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert "adapter_config.json" in names
    config = [json.loads((tmp_path / d / "adapter_config.json").read_text())
              for d in ("run", "cli")]
    assert config[0] == config[1]
    written, expected = _tensors(tmp_path / "run"), _tensors(tmp_path / "cli")
    assert written.keys() == expected.keys()
    for file, tensors in expected.items():
        assert tensors.keys() == written[file].keys()
        for name, value in tensors.items():
            assert written[file][name].dtype == value.dtype and written[file][name].shape != ()
            torch.testing.assert_close(written[file][name], value, rtol=0, atol=0)
    loaded = peft.PeftModel.from_pretrained(base(), tmp_path / "run")
    ids = torch.randint(64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_export_onto_the_base_model_it_was_trained_from_is_refused(trained, capsys):
    tmp, before = trained["tmp"], (trained["tmp"] / "base" / "model.safetensors").read_bytes()
    for target, key in ((tmp / "base", "model.args.config"), (tmp / "tok", "data.args.tokenizer"),
                        (tmp / "corpus.txt", "data.args.files")):
        code, out, err = _cli(capsys, "export", trained["step"], "--format", "hf", "-o", target)
        assert (code, out) == (1, ""), err
        assert err == (f"pp-core: error: -o {str(target)!r} is the run's {key}, which this "
                       f"command reads: it would be overwritten; write -o somewhere else\n")
    assert (tmp / "base" / "model.safetensors").read_bytes() == before


def test_the_export_is_described_by_the_checkpoint_not_the_base_directory(trained, capsys,
                                                                            tmp_path):
    """The base's config edited and its tokenizer gone after training: the export still ships
    the trained weights with the config and tokenizer they were trained with."""
    tmp = trained["tmp"]
    config_file = tmp / "base" / "config.json"
    original = config_file.read_text()
    shutil.move(tmp / "tok", tmp_path / "tok-away")
    config_file.write_text(original.replace("1e-06", "0.5"))
    try:
        code, out, err = _cli(capsys, "export", trained["step"], "--format", "hf", "-o",
                              tmp_path / "hf")
    finally:
        config_file.write_text(original)
        shutil.move(tmp_path / "tok-away", tmp / "tok")
    assert code == 0 and err == "", err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == EXPORTED
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rms_norm_eps"] == 1e-6
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                               local_files_only=True)
    for name, value in trained["model"].state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)


def test_an_export_replaces_the_earlier_one_whole(trained, capsys, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    for stale in ("adapter_config.json", "adapter_model.safetensors",
                  "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (out / stale).write_text("{}")
    (out / "step_00000002").mkdir()  # checkpoint.export_hf's own every-N exports stay
    code, printed, err = _cli(capsys, "export", trained["step"], "--format", "hf", "-o", out)
    assert code == 0 and err == "", err
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPORTED + ["step_00000002"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging left beside
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.odt").write_text("mine")
    code, printed, err = _cli(capsys, "export", trained["step"], "--format", "hf", "-o",
                              tmp_path / "home")
    assert (code, printed) == (1, "")
    assert err == (f"pp-core: error: -o: '{tmp_path}/home' holds 1 entry no export writes "
                   f"('notes.odt'); an export replaces the whole directory, so choose a new or "
                   f"empty directory, or an earlier export's\n")


def test_an_export_onto_a_full_disk_leaves_the_earlier_export(trained, capsys):
    from tests.cases.disks import fill, small_disk

    with small_disk(trained["tmp"] / "full", 1 << 20) as full:
        earlier = full / "hf"
        earlier.mkdir()
        (earlier / "config.json").write_text('{"an": "earlier export"}')
        fill(full, leave=16384)
        code, out, err = _cli(capsys, "export", trained["step"], "--format", "hf", "-o", earlier)
        left = sorted(p.name for p in full.iterdir())
        kept = (earlier / "config.json").read_text()
    assert (code, out) == (1, ""), err
    assert err == (f"pp-core: error: -o: cannot write '{earlier}': no space left on the device; "
                   f"the earlier export is intact; free some space or choose another place\n")
    assert left == [".filler", "hf"] and kept == '{"an": "earlier export"}'


@pytest.fixture
def gpt_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PP_CORE_VERIFIED_CHECKPOINTS", raising=False)
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "ckpt", 1, [GPT(vocab_size=64, dim=16, num_layers=2,
                                                      num_heads=2, max_seq_len=8)], [None],
                           record={"export": {"model": {"name": "gpt", "args": {}}}})


def _corrupt(step: Path, why: str) -> str:
    return (f"pp-core: error: checkpoint '{step}' is incomplete or corrupt: {why}; resume or "
            f"export from another step_NNNNNNNN directory, or delete this one (checkpoint.verify: "
            f"false, or export --no-verify, skips this check)\n")


def test_a_shard_dropped_from_the_checksums_is_refused(gpt_step, capsys):
    listed = json.loads((gpt_step / CHECKSUMS_FILE).read_text())
    del listed["files"]["__0_0.distcp"]
    (gpt_step / CHECKSUMS_FILE).write_text(json.dumps(listed))
    shard = gpt_step / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    code, out, err = _cli(capsys, "export", gpt_step, "-o", "model.pt")
    assert (code, out) == (1, "")
    assert err == _corrupt(gpt_step, f"its file __0_0.distcp is not in its {CHECKSUMS_FILE} "
                                     f"(every file the checkpoint's .metadata names must be "
                                     f"listed and verified)")


def test_an_earlier_releases_checkpoint_stripped_of_its_checksums_is_refused(gpt_step, capsys):
    record = json.loads((gpt_step / RECORD_FILE).read_text())
    (gpt_step / RECORD_FILE).unlink()
    (gpt_step / CHECKSUMS_FILE).unlink()
    (gpt_step / SECTIONS["export"]).write_text(json.dumps(record["export"]))
    code, out, err = _cli(capsys, "export", gpt_step, "-o", "model.pt")
    assert (code, out) == (1, "")
    assert err == _corrupt(gpt_step, f"its {CHECKSUMS_FILE} is missing (its "
                                     f"{SECTIONS['export']} says one was written)")
    assert _cli(capsys, "export", gpt_step, "--no-verify", "-o", "model.pt")[0] == 0


def test_resume_compares_what_the_base_path_holds_not_its_spelling(trained, tmp_path,
                                                                   monkeypatch):
    tmp = trained["tmp"]
    resume = (PIPE % "").replace("checkpoint: {dir: ckpt}", f"checkpoint: {{resume: '{trained['step']}',"
                                                     f" verify: false}}")
    (tmp / "elsewhere").mkdir(exist_ok=True)
    spelled = resume.replace("config: base", f"config: '{tmp}/./base'")
    (tmp / "elsewhere" / "pipe.yaml").write_text(spelled.replace("[corpus.txt]", "[../corpus.txt]")
                                                 .replace("tokenizer: tok", "tokenizer: ../tok"))
    problems, notes = [], []
    check_resume_identity(load_spec(str(tmp / "elsewhere" / "pipe.yaml")), None, problems, notes)
    assert problems == []  # one model, two spellings
    (tmp_path / "base").mkdir()  # another model of the same shapes, at the path it was trained at
    other = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **CONFIG))
    other.save_pretrained(tmp_path / "base")
    shutil.move(tmp / "base", tmp_path / "base-away")
    shutil.move(tmp_path / "base", tmp / "base")
    try:
        (tmp / "pipe.yaml").write_text(resume)
        check_resume_identity(load_spec(str(tmp / "pipe.yaml")), None, problems, notes)
    finally:
        shutil.rmtree(tmp / "base")
        shutil.move(tmp_path / "base-away", tmp / "base")
    assert problems == [
        f"model.args.config: checkpoint.resume: '{trained['step']}' was written for "
        f"model.args.config='{tmp}/base' as it was then; it holds another model now (its config "
        f"or weights changed since); resume with the model it was trained with"]
