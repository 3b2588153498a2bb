"""``checkpoint.export_hf``: the run's ranks write the hand-back directory themselves.

At the end of training (and every ``every`` steps, into ``DIR/step_NNNNNNNN``) every rank hands
its parts' state - DTensor shards of tp and FSDP2 included - to DCP's Hugging Face writer, and
every rank consolidates its share of the output files (:func:`pp_core.app.export.stream.
write_from_ranks`): no rank gathers the model. The directory is the one ``pp-core export
--format hf`` writes from a checkpoint of the same weights (:mod:`pp_core.app.export.hf`); a
model that is not an HF model gets the directory form (weights, index, ``pp_core_model.yaml``);
a ``model.lora`` run gets the PEFT adapter ``pp-core export`` writes of its checkpoint (each rank's
adapter tensors, small, gathered to rank 0 and written by PEFT's own ``save_pretrained``).

The directory is written beside ``DIR`` and renamed in as a whole (:mod:`pp_core.app.export.
staging`); its config and side files come from the same description a checkpoint records
(:mod:`pp_core.app.export.described`), taken as the export is written.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from pp_core.app.export.described import export_record, recorded_files, self_contained
from pp_core.app.export.hf import (default_max_shard_size, hf_target, write_hf_files,
                                   write_model_file)
from pp_core.app.export.staging import staged_directory, staging_paths
from pp_core.checkpoint.expert_state import expert_dtensors
from pp_core.app.export.stream import plan_shards, write_from_ranks
from pp_core.config import resolve_dtype
from pp_core.parallel.dtensor_state import unstride

__all__ = ["export_from_run", "export_due"]


def export_due(spec, step: int) -> Path | None:
    """Where ``checkpoint.export_hf`` writes after ``step``, or None: ``DIR`` after the last
    step, ``DIR/step_NNNNNNNN`` every ``every`` steps before it."""
    export = spec.checkpoint.export_hf
    if not export:
        return None
    if step == spec.train.steps:
        return Path(export["dir"])
    if export.get("every") and step % export["every"] == 0:
        return Path(export["dir"]) / f"step_{step:08d}"
    return None


def _training_dtype(spec) -> torch.dtype:
    given = spec.model.dtype or (spec.model.args or {}).get("dtype")
    return resolve_dtype(given) if given else torch.float32


def _local_state(parts) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # lazy: DCP

    state: dict = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    wrapped = {"model": state}
    unstride(wrapped)  # DCP writes no strided shard (the fused qkv): whole ones
    expert_dtensors(parts, wrapped["model"])
    return wrapped["model"]


KEY = "checkpoint.export_hf"


def export_from_run(spec, parts, output, process_group=None) -> Path:
    """Write the hand-back directory of this run's current weights into ``output``
    (collective over ``process_group``, default every rank): into a staging directory rank 0
    renames in once every rank has written its share."""
    output = Path(output)
    first = dist.get_rank(process_group) == 0
    staged = staged_directory(output, KEY) if first else \
        contextlib.nullcontext(staging_paths(output)[0])
    with staged as staging:
        dist.barrier(group=process_group)  # rank 0 made it
        if spec.model.lora:
            _write_adapter(spec, parts, staging, first, process_group)
        else:
            _write_directory(spec, parts, staging, process_group)
        dist.barrier(group=process_group)
    dist.barrier(group=process_group)  # renamed in before anyone reads it
    return output


def _write_adapter(spec, parts, output: Path, first: bool, process_group) -> None:
    """The PEFT adapter: every rank's trainable tensors (whole) gathered to rank 0."""
    from pp_core.app.check.resume import run_identity  # lazy: DCP
    from pp_core.app.export.peft import write_adapter

    mine = {}
    for part in parts:
        for name, param in part.named_parameters():
            if param.requires_grad:
                value = param.full_tensor() if hasattr(param, "full_tensor") else param
                name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                mine[name] = value.detach().to("cpu", copy=True)
    every = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, mine, group=process_group)
    if first:
        tensors = {name: value for found in every for name, value in found.items()}
        section = self_contained(run_identity(spec)["model"], export_record(spec))
        write_adapter(section, tensors, output)


def _write_directory(spec, parts, output: Path, process_group) -> None:
    record = export_record(spec)
    target = hf_target(record["model"], record)
    state = _local_state(parts)
    dtype = _training_dtype(spec)
    groups = None
    if target is not None:
        entries = [(n, n, target.shapes[n], target.dtypes[n]) for n in target.names]
        total = target.total_parameters
        renamed = _renames(target)
        if renamed:  # save_pretrained writes other names (a VLM's: language_model.model.*)
            state = {renamed.get(name, name): value for name, value in state.items()}
            entries = [(n, n, shape, d) for n, (shape, d) in target.saved.items()]
            groups = target.groups
    else:
        entries, total = _gathered_entries(state, process_group), 0
    layout = plan_shards(entries, dtype, default_max_shard_size(), total, groups)
    write_from_ranks(state, output, layout, process_group)
    if dist.get_rank(process_group) == 0:
        if target is not None:
            write_hf_files(output, target, dtype, record.get("data"), recorded_files(record))
        else:
            write_model_file(output, {k: v for k, v in record["model"].items()
                                      if v not in (None, {})}, "pp-core run")


def _renames(target) -> dict | None:
    """``{model name: saved name}`` when ``save_pretrained`` only renames the model's tensors
    (transformers 5 saves LLaVA's ``model.language_model.*`` as ``language_model.model.*``);
    ``None`` when it writes them as they are, or splits some (MoE experts: not a rename)."""
    if target.convert is None:
        return None
    sources = [source for source, _ in target.groups.values()]
    if len(set(sources)) != len(sources):
        return None
    return {source: saved for saved, (source, _) in target.groups.items()}


def _gathered_entries(state: dict, process_group) -> list:
    """Every rank's ``(name, name, whole shape, dtype)``, in rank order, each name once."""
    mine = [(name, tuple(value.shape), value.dtype) for name, value in state.items()]
    every = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, mine, group=process_group)
    seen: dict = {}
    for found in every:
        for name, shape, dtype in found:
            seen.setdefault(name, (name, name, shape, dtype))
    return list(seen.values())
