"""Hand a run back: a ``save_pretrained`` directory (or a directory form of any model).

``pp-core export CKPT --format hf -o DIR`` and ``checkpoint.export_hf: DIR`` write what
Hugging Face's ``save_pretrained`` writes for the run's model:

* ``config.json``: the run's HF config (the content the checkpoint recorded of
  ``model.args.config``), ``architectures`` and the dtype set; ``generation_config.json`` as
  ``save_pretrained`` writes it (the source directory's, as recorded, when it had one);
* ``model.safetensors``, or shards ``model-0000i-of-0000N.safetensors`` with
  ``model.safetensors.index.json``, split at ``--max-shard-size`` (default: the installed
  ``save_pretrained``'s), the tensors in its order; a tied weight stored once, under the name
  ``save_pretrained`` keeps (``model.embed_tokens.weight``, not ``lm_head.weight``);
* the tokenizer files when the run's data names a tokenizer directory or ``tokenizer.json``;
  the processor's files when it names a processor directory (``image_text``), so a
  vision-language model's directory loads with its processor - as the checkpoint recorded them
  (:mod:`pp_core.app.export.described`; an earlier pp-core's checkpoint: read from those
  directories, the processor through ``AutoProcessor``).

The keys are the unsplit model's names, so every layout (pp, tp, dp_shard / dp_replicate, ep,
any splitter) gives the same directory; the weights stream through
:mod:`pp_core.app.export.stream` (never the whole model in one process). A model that is not
an HF model gets the directory form: the same weight files and index, and
``pp_core_model.yaml``, the YAML ``model`` section that rebuilds it.

A checkpoint knows what it was trained for from the ``export`` section of its record
(:mod:`pp_core.checkpoint.record`; :func:`~pp_core.app.export.described.export_record` fills it
as each checkpoint is saved; older checkpoints: the model of their ``run`` section). The callers
write into a staging directory renamed in whole (:mod:`pp_core.app.export.staging`). :func:`directory_from_state_keys` is the
seam for other directory kinds (e.g. an adapter export): it takes ``[(output name, checkpoint
key)]`` and writes the weights of a directory.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pp_core.app.export.described import (HF_MODELS, TOKENIZER_FILES, config_from_record,
                                          export_record, recorded_export, recorded_files)
from pp_core.checkpoint.directory import check_dir
from pp_core.errors import PipelineError, install_extra

__all__ = ["MODEL_FILE", "export_record", "recorded_export", "export_hf_directory",
           "export_directory_form", "hf_target", "HFTarget", "directory_from_state_keys",
           "write_hf_files", "write_model_file", "default_max_shard_size", "TOKENIZER_FILES"]

MODEL_FILE = "pp_core_model.yaml"


def default_max_shard_size():
    """The installed ``save_pretrained``'s default ``max_shard_size`` (``"50GB"`` in
    transformers 5, ``"5GB"`` in 4); ``"5GB"`` without transformers."""
    try:
        import inspect  # lazy: only an export asks

        from transformers import PreTrainedModel  # lazy: transformers, seconds
    except ImportError:
        return "5GB"
    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


# ----------------------------------------------------------------------------- the HF model


@dataclass
class HFTarget:
    """What ``save_pretrained`` would write for the run's model: ``config``, the meta ``model``,
    the tensor ``names`` in its order (tied copies left out), ``shapes``, ``source`` (the
    ``save_pretrained`` directory the run started from, or None)."""

    config: Any
    model: Any
    names: list[str]
    shapes: dict[str, tuple]
    dtypes: dict[str, torch.dtype]
    source: Path | None
    total_parameters: int
    saved: dict[str, tuple] | None = None
    convert: Any = None
    groups: dict[str, tuple] | None = None


def _tied_targets(model) -> set[str]:
    """The names ``save_pretrained`` drops from a group of tied weights (transformers 5's
    ``all_tied_weights_keys`` targets; 4's ``_tied_weights_keys`` patterns)."""
    found = getattr(model, "all_tied_weights_keys", None)
    if isinstance(found, dict):
        return set(found)
    patterns = getattr(model, "_tied_weights_keys", None) or []
    import re  # lazy: transformers 4 only

    return {name for name, _ in model.named_parameters(remove_duplicate=False)
            if any(re.search(p, name) for p in patterns)}


def hf_target(model_section: dict, record: dict | None = None) -> HFTarget | None:
    """The :class:`HFTarget` of a YAML model section, or None when it is not an HF model; the
    config the checkpoint's ``record`` holds when it holds one (never the base directory)."""
    if model_section.get("name") not in HF_MODELS:
        return None
    try:
        import transformers  # lazy: transformers, seconds
        from transformers import AutoConfig  # lazy: transformers
    except ImportError:
        raise PipelineError(f"pp-core export --format hf needs transformers; "
                            f"{install_extra('transformers')}, or export with --format "
                            f"safetensors") from None
    given = (model_section.get("args") or {}).get("config")
    source = Path(given) if isinstance(given, str) and Path(given).is_dir() else None
    recorded = config_from_record(record or {})
    if recorded is not None:
        config, source = recorded, None
    elif source is not None:
        config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    elif isinstance(given, dict) and given.get("model_type"):
        values = dict(given)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise PipelineError(f"model.args.config={given!r} of the checkpoint's run is neither a "
                            f"local save_pretrained directory nor a dict with model_type; export "
                            f"with --format safetensors instead")
    with torch.device("meta"):
        model = getattr(transformers, HF_MODELS[model_section["name"]]).from_config(config)
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    targets, drop = _tied_targets(model), set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for names in groups.values():
        if len(names) > 1:
            keep = [n for n in names if n not in targets] or sorted(names)[:1]
            drop.update(n for n in names if n != keep[0])
    state = model.state_dict()
    names = [n for n in state if n not in drop]
    target = HFTarget(config, model, names, {n: tuple(state[n].shape) for n in names},
                      {n: state[n].dtype for n in names}, source, model.num_parameters())
    _add_conversion(target, {n: state[n] for n in names})
    return target


def _add_conversion(target: HFTarget, state: dict) -> None:
    """Where ``save_pretrained`` renames or splits weights on the way out (transformers 5's
    ``revert_weight_conversion``: stacked MoE experts become ``experts.<i>.gate_proj.weight``,
    ...), the names it writes (run on the meta model) and the conversion to apply per batch."""
    try:
        from transformers.modeling_utils import revert_weight_conversion  # lazy: transformers 5
    except ImportError:
        return
    reverted = revert_weight_conversion(target.model, dict(state))
    if list(reverted) == list(state):
        return
    target.saved = {n: (tuple(v.shape), v.dtype) for n, v in reverted.items()}
    target.groups = {}  # save_pretrained shards the views of one stacked tensor together
    for name, value in state.items():
        for out in revert_weight_conversion(target.model, {name: value}):
            target.groups[out] = (name, value.numel())
    target.convert = lambda batch: revert_weight_conversion(target.model, batch)


def write_hf_files(output: Path, target: HFTarget, dtype: torch.dtype,
                   data_section: dict | None, files: dict[str, bytes] | None = None) -> None:
    """``config.json``, ``generation_config.json`` and the tokenizer files beside the weights;
    ``files``: those the checkpoint recorded (:mod:`pp_core.app.export.described`), written as
    they are instead of being read from the directories the run named."""
    config = target.config
    config.architectures = [type(target.model).__name__]
    name = str(dtype).removeprefix("torch.")
    if "dtype" in type(config).__dict__ or hasattr(type(config), "dtype"):
        config.dtype = name  # transformers 5 (config.json's "dtype")
    else:
        config.torch_dtype = name
    config.save_pretrained(str(output))
    if files is not None:
        for name, data in files.items():
            (output / Path(name).name).write_bytes(data)
        if "generation_config.json" not in files and \
                getattr(target.model, "can_generate", lambda: False)():
            target.model.generation_config.save_pretrained(str(output))
        return
    generation = None
    if target.source is not None and (target.source / "generation_config.json").is_file():
        from transformers import GenerationConfig  # lazy: transformers

        generation = GenerationConfig.from_pretrained(str(target.source), local_files_only=True)
    elif getattr(target.model, "can_generate", lambda: False)():
        generation = target.model.generation_config
    if generation is not None:
        generation.save_pretrained(str(output))
    processor = ((data_section or {}).get("args") or {}).get("processor")
    if isinstance(processor, str) and os.path.isdir(processor):
        from transformers import AutoProcessor  # lazy: transformers

        AutoProcessor.from_pretrained(processor, local_files_only=True).save_pretrained(
            str(output))
    tokenizer = ((data_section or {}).get("args") or {}).get("tokenizer")
    if isinstance(tokenizer, str) and os.path.exists(tokenizer):
        path = Path(tokenizer)
        files = [path / f for f in TOKENIZER_FILES if (path / f).is_file()] if path.is_dir() \
            else [path]
        for file in files:
            shutil.copyfile(file, output / (file.name if path.is_dir() else "tokenizer.json"))


# ----------------------------------------------------------------------------- from a checkpoint


def directory_from_state_keys(checkpoint, output, names: list[tuple[str, str]], dtype=None,
                              max_shard_size=None, total_parameters: int = 0, metadata=None,
                              converted: HFTarget | None = None, change=None,
                              verify: bool = True):
    """Write the weights of a directory from a DCP checkpoint: ``names`` lists
    ``(output name, checkpoint key)`` in file order (keys as DCP stores them,
    ``model.<fqn>``); returns the :class:`~pp_core.app.export.stream.ShardLayout` written.
    ``converted``: an :class:`HFTarget` whose ``convert`` renames the tensors read from
    ``names``' keys into its ``saved`` names (the file's). ``change``: ``{output name: tensor}
    -> {output name: tensor}`` applied to each batch read before that (``--merge`` adds the
    LoRA deltas there), so no more than a batch is ever held. ``verify``: the checkpoint's
    checksums checked as it is read (once per command)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP

    from pp_core.app.export.stream import plan_shards, write_from_checkpoint

    checkpoint = Path(checkpoint)
    metadata = metadata or check_dir(checkpoint, verify)
    stored = {k: v for k, v in metadata.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    missing = [key for _, key in names if key not in stored]
    if missing:
        raise PipelineError(f"checkpoint {str(checkpoint)!r} lacks {len(missing)} tensor(s) the "
                            f"export needs ({', '.join(missing[:3])}); was it written for this "
                            f"model (model.args)?")
    entries = [(name, key, tuple(stored[key].size), stored[key].properties.dtype)
               for name, key in names]
    size = max_shard_size or default_max_shard_size()
    if converted is None and change is None:
        layout = plan_shards(entries, dtype, size, total_parameters)
        write_from_checkpoint(checkpoint, output, layout, stored, verify=verify)
        return layout
    named = {key: name for name, key in names}
    change = change or (lambda batch: batch)

    def read(state: dict) -> dict:
        return change({named[key]: value for key, value in state.items()})

    if converted is None:
        layout, convert = plan_shards(entries, dtype, size, total_parameters), read
    else:
        trained = _training_dtype(plan_shards(entries, None, size))
        layout = plan_shards([(n, "", shape, trained if d.is_floating_point else d)
                              for n, (shape, d) in converted.saved.items()],
                             dtype, size, total_parameters, converted.groups)
        convert = lambda state: converted.convert(read(state))  # noqa: E731
    write_from_checkpoint(checkpoint, output, layout, stored,
                          source_keys=[key for _, key in names], convert=convert,
                          verify=verify)
    return layout


def _training_dtype(layout) -> torch.dtype:
    floating = [d for d in layout.dtypes.values() if d.is_floating_point]
    return max(set(floating), key=floating.count) if floating else torch.float32


def _checked(checkpoint, output, verify: bool):
    """The checkpoint's DCP metadata and its export record, and ``output`` a directory."""
    checkpoint, output = Path(checkpoint), Path(output)
    if output.exists() and not output.is_dir():
        raise PipelineError(f"-o {str(output)!r} is a file; a directory export needs a "
                            f"directory (new or existing)")
    return checkpoint, output, check_dir(checkpoint, verify), recorded_export(checkpoint)


def export_hf_directory(checkpoint, output, dtype=None, max_shard_size=None,
                        verify: bool = True) -> Path:
    """``pp-core export CKPT --format hf -o DIR``: the ``save_pretrained`` directory."""
    checkpoint, output, metadata, record = _checked(checkpoint, output, verify)
    target = hf_target(record.get("model") or {}, record)
    if target is None:
        found = (record.get("model") or {}).get("name") or "(unknown)"
        raise PipelineError(f"checkpoint {str(checkpoint)!r} is of model {found!r}, not a "
                            f"Hugging Face model (model.name: {' or '.join(HF_MODELS)}); "
                            f"export it with --format safetensors -o DIR (the directory form) "
                            f"instead")
    layout = directory_from_state_keys(checkpoint, output,
                                       [(n, f"model.{n}") for n in target.names], dtype,
                                       max_shard_size, target.total_parameters, metadata,
                                       converted=target if target.convert else None,
                                       verify=verify)
    write_hf_files(output, target, dtype or _training_dtype(layout), record.get("data"),
                   recorded_files(record))
    return output


def export_directory_form(checkpoint, output, dtype=None, max_shard_size=None,
                          verify: bool = True) -> Path:
    """``pp-core export CKPT --format safetensors -o DIR``: any model's weights, index and
    the YAML model section that rebuilds it."""
    checkpoint, output, metadata, record = _checked(checkpoint, output, verify)
    names = [(k[len("model."):], k) for k in metadata.state_dict_metadata
             if k.startswith("model.")]
    layout = directory_from_state_keys(checkpoint, output, names, dtype, max_shard_size,
                                       metadata=metadata, verify=verify)
    section = {k: v for k, v in (record.get("model") or {}).items() if v not in (None, {})}
    if dtype is not None or section.get("dtype"):
        section["dtype"] = str(dtype or _training_dtype(layout)).removeprefix("torch.")
    write_model_file(output, section, "pp-core export")
    return output


def write_model_file(output: Path, section: dict, by: str) -> None:
    """``pp_core_model.yaml``: the YAML model section the directory's weights belong to."""
    import yaml  # lazy: only the directory form writes YAML

    (output / MODEL_FILE).write_text(
        f"# the YAML model section this directory's weights belong to ({by})\n"
        + yaml.safe_dump({"model": section}, sort_keys=False), encoding="utf-8")
