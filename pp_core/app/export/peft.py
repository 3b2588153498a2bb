"""Hand a LoRA run back as PEFT writes it: ``adapter_config.json`` + ``adapter_model.safetensors``.

``pp-core export CKPT --format hf -o DIR`` on a checkpoint of a ``model.lora`` run writes the PEFT
adapter directory that ``PeftModel.from_pretrained(base_model, DIR)`` loads onto the base. It is
PEFT's own ``save_pretrained``: the base model is built on the meta device (no memory, no
weights), ``get_peft_model`` adds the run's adapters, and only the adapter tensors are read from
the checkpoint (any layout wrote it: DCP keys are the unsplit model's names) and put in place -
adapters are small, so one process holds them. ``--merge`` writes the merged model instead
(what ``merge_and_unload`` gives): ``save_pretrained``'s directory for a Hugging Face model, else
``model.safetensors`` with the model's own names, streamed from the checkpoint as the base's
export is (:mod:`pp_core.app.export.stream`), each LoRA layer's delta added per batch.

What the run was: the model the ``run`` section of the checkpoint's record holds
(:func:`pp_core.app.check.resume.run_identity` fills it), which records ``model.lora``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pp_core.app.adapters import lora_config, peft_model
from pp_core.app.export.described import recorded_export, recorded_files, self_contained
from pp_core.app.export.hf import directory_from_state_keys, hf_target, write_hf_files
from pp_core.checkpoint import read_tensors
from pp_core.checkpoint.directory import check_dir
from pp_core.checkpoint.record import read_section
from pp_core.errors import ConfigError

__all__ = ["lora_settings", "export_peft_adapter", "export_merged", "write_adapter"]

_PREFIX = "base_model.model."  # where PEFT keeps the model it changed in place


def lora_settings(checkpoint) -> Optional[dict]:
    """The ``model`` section a checkpoint records when its run had ``model.lora``, else None;
    its ``model.args.config`` the config content the checkpoint recorded when it holds one
    (:func:`~pp_core.app.export.described.self_contained`: the base directory is not read)."""
    model = (read_section(checkpoint, "run") or {}).get("model")
    if not isinstance(model, dict) or not model.get("lora"):
        return None
    return self_contained(model, recorded_export(checkpoint))


def _base_model(section: dict, meta: bool):
    """The run's model without adapters, as its factory builds it (on meta: no memory)."""
    import torch  # lazy: torch, only for an export

    from pp_core._torch_compat import nn_init_skipped
    from pp_core.callables import resolve_callable
    from pp_core.plugin_manager import plugins_or_default

    if section.get("target"):
        factory = resolve_callable(section["target"], "model.target")
    else:
        factory = plugins_or_default(None).models.get(section["name"])
    args = section.get("args") or {}
    if meta:
        with torch.device("meta"), nn_init_skipped():
            return factory(**args)
    torch.manual_seed(0)
    return factory(**args)


def _peft_model(section: dict, meta: bool):
    base = _base_model(section, meta)
    config = lora_config(dict(section["lora"]), base)
    if meta:
        import torch  # lazy: only for an export

        with torch.device("meta"):
            return peft_model(base, config, "exporting a model.lora run")
    return peft_model(base, config, "exporting a model.lora run")


def export_peft_adapter(checkpoint, output, section: Optional[dict] = None,
                        verify: bool = True) -> Path:
    """Write the PEFT adapter directory of a ``model.lora`` checkpoint (module docstring)."""
    section = section or lora_settings(checkpoint)
    if section is None:
        raise ConfigError(f"{str(checkpoint)!r} is not a checkpoint of a model.lora run (its "
                          f"record holds no model.lora); export its weights with "
                          f"pp-core export CKPT -o model.safetensors")
    model = _with_adapters(checkpoint, section, verify)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(output), safe_serialization=True)
    return output


def write_adapter(section: dict, tensors: dict, output) -> Path:
    """``checkpoint.export_hf`` of a ``model.lora`` run: the adapter directory
    :func:`export_peft_adapter` writes, from the trained adapter tensors the ranks hold
    (``{model name: tensor}``, whole)."""
    model = _peft_model(section, meta=True)
    model.load_state_dict({_PREFIX + k: t for k, t in tensors.items()}, strict=False,
                          assign=True)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(output), safe_serialization=True)
    return output


def export_merged(checkpoint, output, section: Optional[dict] = None,
                  verify: bool = True) -> Path:
    """``--merge``: the base with the adapters merged in, streamed - the directory ``pp-core
    export --format hf`` (or the directory form) writes of the base, each LoRA layer's weight
    read batch by batch and given PEFT's own ``get_delta_weight`` as ``merge_and_unload`` adds
    it; only the adapters are held whole."""
    section = section or lora_settings(checkpoint)
    if section is None:
        raise ConfigError(f"--merge merges LoRA adapters, and {str(checkpoint)!r} is not a "
                          f"checkpoint of a model.lora run; drop --merge")
    checkpoint, output = Path(checkpoint), Path(output)
    metadata = check_dir(checkpoint, verify)
    model = _with_adapters(checkpoint, section, verify)
    layers = {f"{name}.weight": module for name, module in model.base_model.model.named_modules()
              if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")}
    if any(any(getattr(layer, "use_dora", {}).values()) for layer in layers.values()):
        raise ConfigError("--merge adds each LoRA layer's delta on the way through, and DoRA "
                          "(model.lora.use_dora) also rescales the weight; export the adapter "
                          "(drop --merge) and merge it with PEFT's merge_and_unload")
    stored = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    key_of = {name.replace(".base_layer.", "."): f"model.{name}" for name in stored
              if ".lora_" not in name}

    def merge(batch: dict) -> dict:
        for name in batch.keys() & layers.keys():
            layer = layers[name]
            delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
            batch[name] = batch[name] + delta.to(batch[name].dtype)
        return batch

    record = recorded_export(checkpoint)
    target = hf_target({k: v for k, v in section.items() if k != "lora"}, record)
    if target is None:
        directory_from_state_keys(checkpoint, output, list(key_of.items()), metadata=metadata,
                                  change=merge, verify=verify)
        return output
    layout = directory_from_state_keys(checkpoint, output,
                                       [(n, key_of[n]) for n in target.names], None, None,
                                       target.total_parameters, metadata,
                                       converted=target if target.convert else None,
                                       change=merge, verify=verify)
    floating = [d for d in layout.dtypes.values() if d.is_floating_point]
    write_hf_files(output, target, max(set(floating), key=floating.count), record.get("data"),
                   recorded_files(record))
    return output


def _with_adapters(checkpoint, section: dict, verify: bool):
    """The run's PEFT model on the meta device with the checkpoint's adapters put in place
    (only they are read: adapters are small)."""
    model = _peft_model(section, meta=True)
    inner = [f"model.{n[len(_PREFIX):]}" for n, p in model.named_parameters() if p.requires_grad]
    tensors = read_tensors(checkpoint, inner, verify)
    model.load_state_dict({_PREFIX + k[len("model."):]: t for k, t in tensors.items()},
                          strict=False, assign=True)
    return model

