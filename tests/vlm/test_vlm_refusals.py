"""What ``pp-core validate`` refuses for a vision-language run, before any process starts: one
line naming the file and line (or the key) and the fix, and nothing after it (no traceback).

Each case is a real pipeline file over a real ``image_text`` file, PNGs and a processor made
here, with one thing wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from pp_core.app import cli  # noqa: E402
from pp_core.plugin_manager import plugins_or_default  # noqa: E402
from tests.cases.vlm import save_processor, tiny_config, write_images_dataset  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_refusals")
    write_images_dataset(tmp, images=(1, 0, 2, 1))
    save_processor("llava", tmp / "processor")
    save_processor_with_three_tokens(tmp / "processor3")
    (tmp / "img" / "bad.png").write_text("not a picture")
    return tmp


def save_processor_with_three_tokens(directory):
    """The LLaVA processor saved as if the tower had no class token (3 tokens per image)."""
    import transformers

    save_processor("llava", directory)
    path = Path(directory) / "processor_config.json"
    values = json.loads(path.read_text())
    values["num_additional_image_tokens"] = 0
    path.write_text(json.dumps(values))
    return transformers


def _spec(files: Path, lines=None, model=None, config=None, **data) -> Path:
    if lines is not None:
        (files / "case.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    values = {
        "model": {"name": "hf_image_text_to_text",
                  "args": {"config": {**tiny_config("llava"), **(config or {})}},
                  **(model or {})},
        "data": {"name": "image_text", "args": {
            "files": "case.jsonl" if lines is not None else "data.jsonl",
            "processor": "processor", "seq_len": 32, **data}},
        "pipeline": {"pp_schedule": "1f1b", "pp_batch_size": 4, "pp_microbatch_size": 1,
                     "loss_fn": "pp_core_builtins.transformers:causal_lm_loss"},
        "distributed": {"pp_size": 2}, "train": {"steps": 1}}
    path = files / "pipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


IMAGE = {"text": "w5 <image> w6", "images": ["img/0_0.png"]}
CASES = {
    "missing image": (dict(lines=[{"text": "w5 <image>", "images": ["img/nope.png"]}]),
                      "data.args: dataset 'image_text' refused these arguments (ConfigError: "
                      "image_text: "
                      "{f}/case.jsonl:1: image '{f}/img/nope.png' does not exist; paths are "
                      "relative to the file)"),
    "not an image": (dict(lines=[IMAGE, {"text": "<image> w7", "images": ["img/bad.png"]}]),
                     "data.args: dataset 'image_text' refused these arguments (ConfigError: image_text: "
                     "{f}/case.jsonl:2: '{f}/img/bad.png' is not an image Pillow can read "
                     "(UnidentifiedImageError); fix or remove it)"),
    "more placeholders": (dict(lines=[{"text": "<image> w5 <image>", "images": ["img/0_0.png"]}]),
                          "data.args: dataset 'image_text' refused these arguments (ConfigError: "
                      "image_text: "
                          "{f}/case.jsonl:1 has 2 image placeholders '<image>' in its text but 1 "
                          "images (more placeholders than images); put the placeholder once per "
                          "image)"),
    "fewer placeholders": (dict(lines=[{"text": "w5", "images": ["img/0_0.png"]}]),
                           "data.args: dataset 'image_text' refused these arguments (ConfigError: "
                      "image_text: "
                           "{f}/case.jsonl:1 has 0 image placeholders '<image>' in its text but "
                           "1 images (fewer placeholders than images); put the placeholder once "
                           "per image)"),
    "seq_len cuts an image": (dict(lines=[{"text": "w5 w6 w7 <image>", "images": ["img/0_0.png"]}],
                                   seq_len=5),
                              "data.args: dataset 'image_text' refused these arguments "
                              "(ConfigError: image_text: {f}/case.jsonl:1: seq_len=5 cuts through its image "
                              "tokens (they end at token 7); raise data.args.seq_len to at least "
                              "7)"),
    "vocabulary": (dict(config={"text_config": {**tiny_config("llava")["text_config"],
                                                "vocab_size": 61}}),
                   "data.args.processor: the processor's vocabulary has 64 tokens but the "
                   "model's embedding only 61; set the model's vocab_size (model.args) to at "
                   "least 64, or use the processor the model was made with"),
    "image token": (dict(config={"image_token_id": 61}),
                    "data.args.processor: the processor's image placeholder is token 60 but the "
                    "model's image_token_id is 61; use the processor saved with the model (or "
                    "set the model's image_token_id)"),
    "tokens per image": (dict(processor="processor3"),
                         "data.args: sample 0 of the batch holds 3 image placeholder tokens but "
                         "its images fill 4 (images of [4, 4, 4, 4] tokens each); each image needs "
                         "the processor's placeholder once in the text, expanded by a processor "
                         "matching the model"),
    "not a VLM": (dict(config={"model_type": "llama", **tiny_config("llava")["text_config"]}),
                  "model.name: model.args.config: model_type 'llama' is not an "
                  "image-text-to-text model; use model.name: hf_causal_lm"),
    "hf_causal_lm given a VLM": (dict(model={"name": "hf_causal_lm"}),
                                 "model.name: model.args.config: model_type 'llava' is a "
                                 "vision-language model; use model.name: hf_image_text_to_text"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_refuses(files, capsys, case):
    arguments, expected = CASES[case]
    path = _spec(files, **arguments)
    code = cli.main(["validate", str(path)])
    out = capsys.readouterr()
    assert code == 1, out.out
    origin = plugins_or_default(None).origin("dataset", "image_text")
    fix = f"; fix data.args, or {origin} if the arguments are right" \
        if "refused these arguments" in expected else ""
    assert out.err == f"pp-core: error: {path}: {expected.format(f=files)}{fix}\n", out.err
