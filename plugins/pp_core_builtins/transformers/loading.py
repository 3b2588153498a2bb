"""Load one stage's tensors from a safetensors checkpoint directory, by their original names.

A checkpoint directory is what ``save_pretrained`` writes: ``model.safetensors``, or shards
listed by ``model.safetensors.index.json``. Each rank opens only the files holding its own
tensors and reads only those tensors (safetensors maps the file; nothing else is read), so no rank
ever holds the whole model. A tied weight saved once (``lm_head.weight`` is omitted when
``tie_word_embeddings=True``) is read from the name it was saved under. A tensor transformers 5
saves converted (stacked MoE experts as ``experts.<i>.gate_proj.weight`` ...) is read from the
names ``save_pretrained`` gives it, each copied into its view of the model's tensor.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from pp_core import ConfigError

__all__ = ["checkpoint_index", "load_part", "has_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def has_checkpoint(path) -> bool:
    """True when ``path`` is a directory holding safetensors weights."""
    path = Path(path)
    return path.is_dir() and ((path / INDEX_FILE).exists() or any(path.glob("*.safetensors")))


def checkpoint_index(path) -> dict[str, Path]:
    """``{tensor name: file}`` for a checkpoint directory (sharded or not)."""
    from safetensors import safe_open  # lazy: safetensors, only when a checkpoint is read

    path = Path(path)
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).exists() else sorted(
        path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"checkpoint directory {str(path)!r} holds no safetensors weights (no {INDEX_FILE} "
            f"and no *.safetensors); save the model with save_pretrained(..., "
            f"safe_serialization=True) or point to the right directory")
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                index[name] = file
    return index


def _sources(part: nn.Module, targets: dict) -> dict[str, list[str]]:
    """Per name, the names its tensor may be saved under: itself, then each name tied to it."""
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, tensor in targets.items():
        aliases[id(tensor)].append(name)
    tied = getattr(part, "pp_tied_parameters", {})
    # a layer PEFT wrapped (model.lora) keeps the original weight as ``<layer>.base_layer.*``
    return {name: [name, *tied.get(name, ()), *aliases[id(tensor)],
                   *([name.replace(".base_layer.", ".")] if ".base_layer." in name else [])]
            for name, tensor in targets.items()}


def _converted_sources(part: nn.Module, targets: dict, index: dict) -> dict[str, dict]:
    """``{name: {saved name: positions in the part's tensor}}`` for the tensors
    ``save_pretrained`` writes converted. transformers 5's ``revert_weight_conversion`` (what it
    runs on the way out: split, unbind, transpose) applied to the positions of the part's tensor
    (an index tensor of its shape) says where each element of each saved tensor belongs; the
    positions are transient, one tensor at a time."""
    try:
        from transformers import PreTrainedModel  # lazy: transformers, seconds to import
        from transformers.modeling_utils import revert_weight_conversion  # transformers 5
    except ImportError:
        return {}
    if not targets or not isinstance(part, PreTrainedModel):
        return {}
    found = {}
    for name, tensor in targets.items():
        shape_only = torch.empty(tensor.shape, device="meta")
        if revert_weight_conversion(part, {name: shape_only}).keys() == {name}:
            continue  # not converted: told without memory
        dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        positions = torch.arange(tensor.numel(), dtype=dtype).view(tensor.shape)
        saved = revert_weight_conversion(part, {name: positions})
        if all(source in index for source in saved):
            found[name] = saved
    return found


def load_part(part: nn.Module, path, strict: bool = True) -> list[str]:
    """Copy this part's parameters and persistent buffers from checkpoint ``path``, in place.

    :param strict: a tensor of the part found under none of its names is an error (else it keeps
        its initial value and its name is returned).
    :returns: the names not found (empty when ``strict``).
    """
    from safetensors import safe_open  # lazy: safetensors, only when a checkpoint is read

    index = checkpoint_index(path)
    targets = part.state_dict(keep_vars=True)
    by_file: dict[Path, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
    missing = []
    sources = _sources(part, targets)
    for name, tensor in targets.items():
        source = next((n for n in sources[name] if n in index), None)
        if source is None:
            missing.append(name)
        else:
            by_file[index[source]].append((name, source, tensor))
    missing = [name for name in missing if ".lora_" not in name]  # adapters: not in a base
    converted = _converted_sources(part, {name: targets[name] for name in missing}, index)
    for name, saved in converted.items():
        missing.remove(name)
        for source, positions in saved.items():
            by_file[index[source]].append((name, source, (targets[name], positions)))
    if missing and strict:
        raise ConfigError(
            f"checkpoint {str(path)!r} has no tensor for {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + "; is it a checkpoint of this architecture and size? (names must match the "
              "model's state_dict keys)")
    with torch.no_grad():
        for file, items in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name, source, tensor in items:
                    value = handle.get_tensor(source)
                    if isinstance(tensor, tuple):  # converted: its elements go to their places
                        tensor, positions = tensor
                        tensor.view(-1).index_copy_(0, positions.reshape(-1).long(),
                                                    value.reshape(-1).to(tensor.dtype))
                        continue
                    if value.shape != tensor.shape:
                        raise ConfigError(
                            f"checkpoint tensor {source!r} in {file.name} has shape "
                            f"{tuple(value.shape)}, the model's {name!r} has "
                            f"{tuple(tensor.shape)}; the config does not match the checkpoint")
                    tensor.copy_(value)
    return missing
