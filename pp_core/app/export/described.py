"""What an export needs to describe the model, taken when the checkpoint is saved.

The ``export`` section of a checkpoint's record (:mod:`pp_core.checkpoint.record`, covered by
its checksums) holds the model and data sections of the run, the training dtype and, for a
Hugging Face model, ``hf``: the content of the run's ``config.json`` (or the config mapping the
YAML gave), and the text of the files an export copies beside the weights - the
``generation_config.json`` of the base directory, the tokenizer's files, the processor's::

    "hf": {"config": {"model_type": "llama", ...},
           "files": {"generation_config.json": {"text": "..."},
                     "tokenizer.model": {"base64": "..."}}}

An export reads these, never the base, tokenizer or processor directory again: a directory
edited, moved or deleted after training changes nothing the export writes (the trained weights
ship with the function they were trained as). Checkpoints saved before the section grew ``hf``
are exported as before, from the directories their record names.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from pathlib import Path

__all__ = ["export_record", "recorded_export", "recorded_files", "config_from_record",
           "self_contained", "TOKENIZER_FILES", "PROCESSOR_FILES", "HF_MODELS"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
PROCESSOR_FILES = TOKENIZER_FILES + ("preprocessor_config.json", "processor_config.json",
                                     "video_preprocessor_config.json")
HF_MODELS = {"hf_causal_lm": "AutoModelForCausalLM",
             "hf_image_text_to_text": "AutoModelForImageTextToText"}
"""The HF model names, and the ``Auto`` class that builds (and ``from_pretrained`` loads) each."""
DATA_PATHS = ("tokenizer", "processor")  # data arguments the export reads: kept absolute


def _absolute(value):
    if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
        return str(Path(os.path.expanduser(value)).resolve())
    return value


def _training_dtype(spec) -> str:
    given = spec.model.dtype or (spec.model.args or {}).get("dtype")
    return str(given).removeprefix("torch.") if given else "float32"


def export_record(spec) -> dict:
    """The record's ``export`` section (the module docstring), plain values as read back."""
    args = dict(spec.model.args)
    if "config" in args:
        args["config"] = _absolute(args["config"])
    data_args = {k: _absolute(v) if k in DATA_PATHS else v for k, v in spec.data.args.items()}
    record = {"model": {"name": spec.model.name, "target": spec.model.target, "args": args,
                        "dtype": spec.model.dtype},
              "data": {"name": spec.data.name, "args": data_args},
              "dtype": _training_dtype(spec)}
    if spec.model.name in HF_MODELS and not spec.model.target:
        record["hf"] = _described(args.get("config"), data_args)
    return json.loads(json.dumps(record, default=str))


def _file(path: Path) -> dict:
    data = path.read_bytes()
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:  # tokenizer.model (sentencepiece) is binary
        return {"base64": base64.b64encode(data).decode("ascii")}


def _described(config, data_args: dict) -> dict:
    """``{"config": ..., "files": ...}`` of an HF model's run, read now."""
    files: dict[str, dict] = {}
    if isinstance(config, str) and os.path.exists(config):
        source = Path(config)
        config_file = source / "config.json" if source.is_dir() else source
        content = json.loads(config_file.read_text(encoding="utf-8"))
        if source.is_dir() and (source / "generation_config.json").is_file():
            files["generation_config.json"] = _file(source / "generation_config.json")
    else:
        content = config if isinstance(config, dict) else None
    tokenizer, processor = data_args.get("tokenizer"), data_args.get("processor")
    for given, names in ((tokenizer, TOKENIZER_FILES), (processor, PROCESSOR_FILES)):
        if not (isinstance(given, str) and os.path.exists(given)):
            continue
        path = Path(given)
        if path.is_dir():
            files.update({name: _file(path / name) for name in names if (path / name).is_file()})
        else:
            files["tokenizer.json"] = _file(path)
    return {"config": content, "files": files}


def recorded_export(checkpoint) -> dict:
    """What the checkpoint records for its export (older ones: the model of their ``run``
    section), or ``{}``."""
    from pp_core.checkpoint.record import read_section  # lazy: keeps this module light

    for section in ("export", "run"):
        value = read_section(checkpoint, section)
        if value is not None and isinstance(value.get("model"), dict):
            return value
    return {}


def recorded_files(record: dict) -> dict[str, bytes] | None:
    """``{file name: bytes}`` the export writes beside the weights, as recorded; ``None`` for a
    checkpoint saved before they were recorded."""
    hf = record.get("hf")
    if not isinstance(hf, dict) or not isinstance(hf.get("files"), dict):
        return None
    return {name: (value["text"].encode("utf-8") if "text" in value
                   else base64.b64decode(value["base64"]))
            for name, value in hf["files"].items() if isinstance(value, dict)}


def config_from_record(record: dict):
    """The transformers config the run trained, from the recorded ``config.json`` content (read
    as ``from_pretrained`` reads a directory), or ``None`` when the record holds none."""
    content = (record.get("hf") or {}).get("config")
    if not isinstance(content, dict):
        return None
    from transformers import AutoConfig  # lazy: transformers, seconds

    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text(json.dumps(content), encoding="utf-8")
        return AutoConfig.from_pretrained(scratch, local_files_only=True)


def self_contained(model_section: dict, record: dict) -> dict:
    """``model_section`` rebuilt from what the record holds: ``model.args.config`` the recorded
    config content, no ``checkpoint`` to read weights from (they come from the checkpoint)."""
    content = (record.get("hf") or {}).get("config")
    if not isinstance(content, dict) or not content.get("model_type"):
        return model_section
    args = {k: v for k, v in (model_section.get("args") or {}).items() if k != "checkpoint"}
    named = args.get("config")  # kept as the name an adapter records for its base model
    config = {**({"name_or_path": named} if isinstance(named, str) else {}), **content}
    return {**model_section, "args": {**args, "config": config}}
