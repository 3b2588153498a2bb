"""``model.lora`` and ``model.freeze`` in a pipeline file, and the PEFT adapter export.

A LoRA run of the tiny GPT at pp=2 (``pp-core run``'s launcher, gloo) trains only the adapters
(the base is bit for bit the factory's), its checkpoint exports with ``pp-core export --format
hf`` to what ``PeftModel.from_pretrained`` loads, and the loaded model gives the trained logits;
``--merge`` gives them without PEFT. Bad settings are one message naming the key.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pp_core.app import cli
from pp_core.app.adapters import apply_adapters
from pp_core.checkpoint import checkpoint_path, load_into_model, read_model_state_dict
from pp_core.checkpoint.record import read_section
from pp_core.app.factories import build_model
from pp_core.app.spec import SpecError, apply_overrides, parse_spec
from pp_core.errors import ConfigError
from pp_core_builtins.models import GPT
from tests.cases.specs import tiny_gpt_spec
from tests.cases.warm import warm_launch

MODEL = {"vocab_size": 32, "dim": 16, "num_layers": 4, "num_heads": 2, "max_seq_len": 8}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["qkv", "proj"]}
BASE = tiny_gpt_spec(model={"args": MODEL, "lora": LORA},
                     pipeline={"pp_schedule": "zero_bubble"}, distributed={"device": "cpu"},
                     train={"steps": 3, "optimizer": {"name": "AdamW", "lr": 0.05}})


def spec_of(*overrides: str, base=BASE):
    return parse_spec(apply_overrides(base, overrides), "lora.yaml")


def tokens():
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora")
    spec = spec_of(f"checkpoint.dir={directory / 'ckpt'}", "checkpoint.every=3")
    losses = warm_launch(spec)[0]["losses"]
    return spec, checkpoint_path(directory / "ckpt", 3), losses


@pytest.mark.ranks
def test_a_lora_run_trains_the_adapters_only(lora_run):
    spec, step, losses = lora_run
    assert len(losses) == 3 and losses[-1] < losses[0]
    trained = read_model_state_dict(step)
    torch.manual_seed(spec.train.seed)
    base = GPT(**MODEL)  # the factory's weights under the same seed
    names = {n.replace(".base_layer", ""): n for n in trained if ".lora_" not in n}
    for plain, tensor in base.state_dict().items():
        assert torch.equal(trained[names[plain]], tensor), plain  # bit for bit
    start = build_model(spec)
    moved = [n for n in trained if ".lora_" in n
             and not torch.equal(trained[n], start.state_dict()[n])]
    assert moved and all(".lora_" in n for n in moved)
    run = read_section(step, "run")
    assert run["model"]["lora"] == LORA


@pytest.mark.ranks
def test_a_lora_checkpoint_holds_adapter_optimizer_state_only_and_resumes(lora_run, tmp_path):
    import torch.distributed.checkpoint as dcp  # noqa: F401 - the metadata reader below

    from pp_core.checkpoint import SafeReader

    spec, step, losses = lora_run
    keys = SafeReader(str(step)).read_metadata().state_dict_metadata
    moments = [k for k in keys if k.startswith("optim.state.")]
    assert moments and all(".lora_" in k for k in moments), moments[:4]
    resumed = warm_launch(spec_of(f"checkpoint.dir={tmp_path}", f"checkpoint.resume={step}",
                                  "train.steps=4"))[0]["losses"]
    assert len(resumed) == 1 and resumed[0] < losses[0]


@pytest.mark.ranks
def test_the_adapter_export_loads_with_peft_and_gives_the_trained_logits(lora_run, tmp_path):
    from peft import PeftModel

    spec, step, _ = lora_run
    trained = build_model(spec)
    load_into_model(step, trained)
    with torch.no_grad():
        want = trained(tokens())
    out = tmp_path / "adapter"
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    torch.manual_seed(spec.train.seed)
    loaded = PeftModel.from_pretrained(GPT(**MODEL), str(out)).eval()
    with torch.no_grad():
        got = loaded(tokens())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    merged_dir = tmp_path / "merged"
    assert cli.main(["export", str(step), "--format", "hf", "--merge", "-o", str(merged_dir)]) == 0
    from safetensors.torch import load_file

    merged = GPT(**MODEL)
    merged.load_state_dict(load_file(str(merged_dir / "model.safetensors")))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens()), want, rtol=1e-5, atol=1e-5)


def test_freeze_patterns_freeze_and_a_pattern_that_matches_nothing_is_named():
    spec = spec_of("model.lora=null", "model.freeze=[tok_*, pos_*, layers.0, layers.1.ffn]")
    model = build_model(spec)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen and all(n.startswith(("tok_emb", "pos_emb", "layers.0.", "layers.1.ffn.")) for n in frozen)
    assert any(n.startswith("layers.1.attention_norm") for n, p in model.named_parameters()
               if p.requires_grad)
    with pytest.raises(ConfigError, match=r"model.freeze: 'layer.0' matches no parameter"):
        build_model(spec_of("model.lora=null", "model.freeze=[layer.0]"))


def test_bad_lora_settings_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"model.lora.rank is not a LoRA setting"):
        build_model(spec_of("model.lora.rank=4"))
    with pytest.raises(ConfigError, match=r"model.lora.use_dora with distributed.tp_size=2"):
        apply_adapters(GPT(**MODEL), {**LORA, "use_dora": True}, None, tp_size=2)
    with pytest.raises(SpecError) as info:
        spec_of("model.lora=3")
    assert "model.lora" in str(info.value)


def test_peft_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ConfigError, match=r"pip install 'pp-core-torch\[lora\]'"):
        build_model(spec_of())
