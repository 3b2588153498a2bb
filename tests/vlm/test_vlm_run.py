"""Vision-language models through ``pp-core run``: a user's files in, a ``from_pretrained``
directory out.

A LLaVA-NeXT made here (random weights, its processor built locally: a word-level tokenizer and
Pillow's any-resolution image processing) trains on an ``image_text`` JSON-lines file whose
samples hold 0..3 PNGs of several sizes. Three runs: ``pp_size: 1`` (the reference), pp2 x dp2
under ZB-H1 with the encoder on stages of its own, and pp2 x tp2 under the V schedule with LoRA
on the language model and the vision tower frozen - the common recipe. The first two log the same
losses (fp32, 1e-5). ``checkpoint.export_hf`` and ``pp-core export --format hf`` write what
``AutoModelForImageTextToText.from_pretrained`` and ``AutoProcessor.from_pretrained`` load, with
the trained model's logits; the LoRA run's adapter loads with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pp_core.app import cli  # noqa: E402
from pp_core.checkpoint import checkpoint_path, read_model_state_dict  # noqa: E402
from tests.cases.hf_export import run_losses, run_losses_here  # noqa: E402
from tests.cases.vlm import (batch, save_processor, tiny_config, tiny_vlm,  # noqa: E402
                             write_images_dataset)

pytestmark = [pytest.mark.cli, pytest.mark.ranks]

STEPS = 3
IMAGES = (1, 0, 2, 3, 0, 1, 0, 2)


def _units():
    from pp_core_builtins.transformers.vision_layout import find_vision_layout

    units = find_vision_layout(tiny_vlm("llava_next")).units()
    return [[f for unit in units[:3] for f in unit], [f for unit in units[3:] for f in unit]]


def _spec(tmp: Path, data: dict, pp: int, name: str, schedule="1f1b", **extra) -> dict:
    return {
        "model": {"name": "hf_image_text_to_text",
                  "args": {"config": tiny_config("llava_next"), "attn_implementation": "eager"},
                  **extra.pop("model", {})},
        "data": {"name": "image_text", "args": {**data, "seq_len": 160, "shuffle": False}},
        "pipeline": {"pp_schedule": schedule, "pp_batch_size": len(IMAGES) // (
            2 if extra.get("distributed", {}).get("dp_shard") else 1), "pp_microbatch_size": 2,
                     "loss_fn": "pp_core_builtins.transformers:causal_lm_loss",
                     **extra.pop("pipeline", {})},
        "distributed": {"pp_size": pp, "device": "cpu", **extra.pop("distributed", {})},
        "train": {"steps": STEPS, "log_every": 1, "optimizer": {"name": "SGD", "lr": 0.5}},
        "output": {"progress": "off", "summary": False, "metrics": str(tmp / f"{name}.jsonl")},
        **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    data = {"files": write_images_dataset(tmp / "data", IMAGES),
            "processor": save_processor("llava_next", tmp / "processor")}
    # the pp2 x dp2 run is the command end to end (its own interpreter); the reference and the
    # LoRA run go through the same cli.main here, their ranks forked warm from this process
    one = run_losses_here(tmp, _spec(tmp, data, 1, "one"))
    dp = run_losses(tmp, _spec(tmp, data, 2, "dp", "zero_bubble", distributed={"dp_shard": 2},
                               pipeline={"module_fqns_per_model_part": _units()},
                               checkpoint={"dir": str(tmp / "ckpt"),
                                           "export_hf": str(tmp / "run_export")}))
    lora = {"r": 4, "alpha": 8, "target_modules": r".*language_model.*\.(q_proj|v_proj)",
            "init_lora_weights": False}
    tp = run_losses_here(tmp, _spec(tmp, data, 2, "tp", "v_schedule",
                                    distributed={"tp_size": 2},
                                    model={"lora": lora, "freeze": ["model.vision_tower"]},
                                    checkpoint={"dir": str(tmp / "lora_ckpt")}))
    return {"tmp": tmp, "one": one, "dp": dp, "tp": tp}


def test_pp2_dp2_logs_the_losses_of_one_process(runs):
    assert len(runs["one"]) == STEPS
    torch.testing.assert_close(torch.tensor(runs["dp"]), torch.tensor(runs["one"]),
                               rtol=0, atol=1e-5)
    assert runs["one"][-1] < runs["one"][0]  # it trains


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(runs):
    tmp = runs["tmp"]
    step = checkpoint_path(tmp / "ckpt", STEPS)
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(tmp / "export")]) == 0
    for name in ("config.json", "model.safetensors"):  # the ranks' own export: the same bytes
        assert (tmp / "run_export" / name).read_bytes() == (tmp / "export" / name).read_bytes()
    exported = transformers.AutoModelForImageTextToText.from_pretrained(
        str(tmp / "export"), attn_implementation="eager", local_files_only=True)
    processor = transformers.AutoProcessor.from_pretrained(str(tmp / "export"))
    assert type(processor).__name__ == "LlavaNextProcessor"
    trained = tiny_vlm("llava_next")
    trained.load_state_dict(read_model_state_dict(step), strict=True)
    inputs, _ = batch("llava_next", (2, 0, 1))
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, trained(**inputs).logits,
                                   rtol=0, atol=1e-6)
        assert not torch.allclose(tiny_vlm("llava_next")(**inputs).logits,
                                  trained(**inputs).logits, atol=1e-4)  # it did train


def test_lora_run_with_a_frozen_tower_exports_a_peft_adapter(runs):
    from peft import PeftModel

    tmp = runs["tmp"]
    assert len(runs["tp"]) == STEPS and runs["tp"][-1] < runs["tp"][0]
    step = checkpoint_path(tmp / "lora_ckpt", STEPS)
    state = read_model_state_dict(step)
    assert cli.main(["export", str(step), "--format", "hf", "-o", str(tmp / "adapter")]) == 0
    config = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4
    loaded = PeftModel.from_pretrained(tiny_vlm("llava_next"), str(tmp / "adapter"))
    names = {n.removeprefix("base_model.model."): p for n, p in loaded.named_parameters()}
    adapters = [n for n in state if ".lora_" in n]
    assert adapters and all(".language_model." in n for n in adapters)
    for name in adapters:
        torch.testing.assert_close(names[name], state[name], rtol=0, atol=0)
    tower = {n: t for n, t in state.items() if ".vision_tower." in n}
    base = dict(tiny_vlm("llava_next").named_parameters())
    assert all(torch.equal(t, base[n]) for n, t in tower.items())  # frozen: never stepped
