"""Safetensors directories written tensor by tensor, never the whole model in one process.

Both ways into a directory end in torch's own DCP Hugging Face machinery:

* from a DCP checkpoint (``pp-core export``, one process, no process group):
  :func:`write_from_checkpoint` reads a bounded batch of tensors at a time
  (:func:`pp_core.checkpoint.read_tensors`), casts them, and writes each batch with DCP's
  ``HuggingFaceStorageWriter`` as one DCP-sharded safetensors file; torch's ``consolidate_safetensors_files`` then writes the
  final files tensor by tensor (it holds one tensor's bytes at a time);
* from the ranks of a run (``checkpoint.export_hf``): :func:`write_from_ranks` hands every rank's
  state (DTensors and all) to ``dcp.save`` with the same writer, then every rank consolidates its
  share of the output files (``consolidate_safetensors_files_on_every_rank``). No gather.

Either way the result is :class:`ShardLayout`'s files: ``model.safetensors``, or the shards and
``model.safetensors.index.json`` named and split as Hugging Face's ``save_pretrained`` names and
splits them (huggingface_hub's ``split_state_dict_into_shards_factory``). What goes beside the
weights (``config.json``, tokenizer, the YAML model section) is the caller's.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pp_core._torch_compat import consolidate_hf_safetensors
from pp_core.errors import PipelineError, install_extra

__all__ = ["ShardLayout", "plan_shards", "write_from_checkpoint", "write_from_ranks",
           "DEFAULT_BATCH_BYTES", "SINGLE_FILE", "INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_BATCH_BYTES = 64 * 2**20
"""The most bytes :func:`write_from_checkpoint` reads from a checkpoint at once (a larger tensor
is read alone)."""


@dataclass
class ShardLayout:
    """Where each tensor goes: ``sources`` maps each output name (in file order) to the key it
    is read from; ``index_of`` maps it to its file (1-based); ``shapes`` / ``dtype``: what is
    written."""

    sources: dict[str, str]
    index_of: dict[str, int]
    shapes: dict[str, tuple]
    dtype: torch.dtype | None
    num_files: int
    total_size: int
    total_parameters: int = 0
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def out_dtype(self, name: str, stored: torch.dtype) -> torch.dtype:
        """The dtype ``name`` is written in: the export dtype for floating tensors."""
        if self.dtype is None or not stored.is_floating_point:
            return stored
        return self.dtype

    def file_name(self, index: int) -> str:
        if self.num_files == 1:
            return SINGLE_FILE
        return f"model-{index:05d}-of-{self.num_files:05d}.safetensors"


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def plan_shards(entries: list[tuple[str, str, tuple, torch.dtype]], dtype: torch.dtype | None,
                max_shard_size, total_parameters: int = 0,
                groups: dict | None = None) -> ShardLayout:
    """The files of ``entries`` (``(output name, source key, shape, stored dtype)``, in order),
    split as ``save_pretrained`` splits a state dict at ``max_shard_size`` (bytes or ``"5GB"``).

    ``groups``: ``{output name: (storage key, elements)}`` for outputs that are views of one
    tensor (``save_pretrained`` keeps such views in one file and counts the storage once)."""
    layout = ShardLayout({}, {}, {}, dtype, 1, 0, total_parameters)
    sizes = {}
    for name, source, shape, stored in entries:
        layout.sources[name], layout.shapes[name] = source, tuple(shape)
        layout.dtypes[name] = layout.out_dtype(name, stored)
        sizes[name] = _nbytes(shape, layout.dtypes[name])
    groups = groups or {}

    def storage_size(item):
        name = item[0]
        if name in groups:
            return groups[name][1] * torch.empty((), dtype=layout.dtypes[name]).element_size()
        return sizes[name]

    try:
        from huggingface_hub import split_state_dict_into_shards_factory  # lazy: an export only
    except ImportError:  # no transformers installed: the same greedy rule, without groups
        shards = _greedy(sizes, max_shard_size)
    else:
        split = split_state_dict_into_shards_factory(
            {name: (name,) for name in sizes}, get_storage_size=storage_size,
            get_storage_id=lambda item: groups[item[0]][0] if item[0] in groups else None,
            filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
        shards = list(split.filename_to_tensors.values())
    layout.num_files = len(shards)
    for number, names in enumerate(shards, start=1):
        for name in names:
            layout.index_of[name] = number
    layout.sources = {name: layout.sources[name] for name in layout.index_of}
    layout.total_size = sum(sizes.values())
    return layout


def _greedy(sizes: dict[str, int], max_shard_size) -> list[list[str]]:
    """huggingface_hub's split in order: a tensor over the limit alone, else a new shard when
    the next tensor would tip the current one over it."""
    if isinstance(max_shard_size, str):
        from pp_core.planning.sizes import parse_size  # lazy: only without huggingface_hub

        max_shard_size = parse_size(max_shard_size, what="--max-shard-size")
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current or not shards else shards


def _writer(path: Path, names, save_distributed: bool, mapping: dict[str, int] | None = None):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter  # lazy: DCP, seconds

    try:
        import safetensors  # noqa: F401  # lazy: DCP's HF writer writes through it
    except ImportError:
        raise PipelineError(f"a directory export writes safetensors files: pip install "
                            f"safetensors (or {install_extra('transformers')})") from None

    return HuggingFaceStorageWriter(str(path), save_distributed=save_distributed,
                                    fqn_to_index_mapping=mapping or dict.fromkeys(names, 1))


def _batches(keys: list[str], stored: dict, budget: int):
    """Checkpoint keys in order, in runs of at most ``budget`` bytes (a larger one alone)."""
    batch, size = [], 0
    for key in keys:
        nbytes = _nbytes(stored[key].size, stored[key].properties.dtype)
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += nbytes
    if batch:
        yield batch


def write_from_checkpoint(checkpoint, output, layout: ShardLayout, stored: dict,
                          budget: int = DEFAULT_BATCH_BYTES, convert=None,
                          source_keys: list[str] | None = None,
                          verify: bool = True) -> list[Path]:
    """Write ``layout``'s safetensors files into ``output`` from the DCP checkpoint at
    ``checkpoint`` (``stored``: ``{source key: TensorStorageMetadata}``); returns the files.

    ``convert``: ``{source key: tensor} -> {output name: tensor}`` applied to each batch read
    (e.g. transformers' own ``revert_weight_conversion``) over ``source_keys``; without it each
    output name takes its ``layout.sources`` key. ``verify``: the checkpoint's checksums
    checked by the first read (:func:`~pp_core.checkpoint.read_tensors`).
    """
    import torch.distributed.checkpoint as dcp  # lazy: DCP, seconds

    from pp_core.checkpoint import read_tensors
    from pp_core.checkpoint.state import single_process_quiet

    output = Path(output)
    scratch = _scratch(output)
    _clear_old_weights(output)
    sharded = scratch / "sharded"
    sharded.mkdir(parents=True)
    named: dict[str, list[str]] = {}
    for name, key in layout.sources.items():
        named.setdefault(key, []).append(name)
    keys = source_keys if convert is not None else list(named)
    try:
        for number, batch in enumerate(_batches(keys, stored, budget)):
            state = read_tensors(checkpoint, batch, verify)
            found = convert(state) if convert is not None else \
                {n: state[k] for k in batch for n in named[k]}
            unknown = sorted(set(found) - set(layout.index_of))
            if unknown:
                raise PipelineError(f"the export wrote tensor(s) its plan lacks "
                                    f"({', '.join(unknown[:3])}); this is a pp-core bug")
            out = {n: v.to(layout.dtypes[n]).contiguous() for n, v in found.items()}
            del state, found
            where = scratch / f"batch-{number}"
            with single_process_quiet():
                dcp.save(out, storage_writer=_writer(where, out, True), no_dist=True)
            del out
            for file in where.glob("*.safetensors"):
                os.replace(file, sharded / f"part-{number:05d}-{file.name}")
            shutil.rmtree(where, ignore_errors=True)
        return _consolidate(sharded, output, layout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_from_ranks(parts_state: dict, output, layout: ShardLayout, process_group=None) -> None:
    """Write ``layout``'s files into ``output`` from every rank's share (collective).

    ``parts_state``: this rank's ``{output name: tensor or DTensor}`` (whole names, whole
    shapes; a DTensor writes only its shards; the same replicated tensor on several ranks is
    written once). Rank 0 of ``process_group`` writes the index.
    """
    import torch.distributed as dist  # lazy: only a run's export
    import torch.distributed.checkpoint as dcp

    output = Path(output)
    rank = dist.get_rank(process_group)
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, group=process_group, group_src=0)
    scratch = output / f".pp-core-export-{token[0]}"
    sharded = scratch / "sharded"
    sharded.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _clear_old_weights(output)
    dist.barrier(group=process_group)
    state = {name: value.to(layout.dtypes[name]) for name, value in parts_state.items()
             if name in layout.index_of}
    dcp.save(state, storage_writer=_writer(sharded, layout.index_of, True, layout.index_of),
             process_group=process_group)
    del state
    dist.barrier(group=process_group)
    _consolidate(sharded, output, layout, process_group, distributed=True)
    dist.barrier(group=process_group)
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def _scratch(output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    return output / f".pp-core-export-{uuid.uuid4().hex[:12]}"


_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def _clear_old_weights(output: Path) -> None:
    """Drop the weight files and index of an earlier export into ``output`` (as
    ``save_pretrained`` does), so no stale shard outlives the new layout."""
    for path in output.iterdir() if output.is_dir() else ():
        if _WEIGHT_FILE.fullmatch(path.name) or path.name == INDEX_FILE:
            path.unlink()


def _consolidate(sharded: Path, output: Path, layout: ShardLayout, process_group=None,
                distributed: bool = False) -> list[Path]:
    """torch's consolidation of the DCP-sharded files into ``layout``'s files (on every rank of
    ``process_group`` its share of them when ``distributed``), then the names and the index of
    ``save_pretrained`` (by rank 0)."""
    consolidate_hf_safetensors(str(sharded), str(output), layout.index_of, process_group,
                               distributed)
    if distributed:
        import torch.distributed as dist  # lazy: only a run's export

        dist.barrier(group=process_group)
        if dist.get_rank(process_group) != 0:
            return []
    files = []
    for index in range(1, layout.num_files + 1):
        final = output / layout.file_name(index)
        if layout.num_files == 1:
            os.replace(output / _dcp_name(1, 1), final)
        files.append(final)
    _write_index(output, layout)
    return files


def _dcp_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _write_index(output: Path, layout: ShardLayout) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it (only when sharded)."""
    index_file = output / INDEX_FILE
    if layout.num_files == 1:
        index_file.unlink(missing_ok=True)
        return
    metadata = {"total_size": layout.total_size}
    if layout.total_parameters:
        metadata = {"total_parameters": layout.total_parameters, **metadata}
    weight_map = {name: layout.file_name(i) for name, i in layout.index_of.items()}
    text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2,
                      sort_keys=True) + "\n"
    try:
        index_file.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise PipelineError(f"cannot write {str(index_file)!r}: {exc.strerror or exc}") from None
