"""``checkpoint.export_hf``: the run's ranks write the hand-back directory themselves.

At the end of training (and every ``every`` steps, into ``DIR/step_NNNNNNNN``) every rank hands
its parts' state - DTensor shards of tp and FSDP2 included - to DCP's Hugging Face writer, and
every rank consolidates its share of the output files (:func:`pp_core.app.export.stream.
write_from_ranks`): no rank gathers the model. The directory is the one ``pp-core export
--format hf`` writes from a checkpoint of the same weights (:mod:`pp_core.app.export.hf`); a
model that is not an HF model gets the directory form (weights, index, ``pp_core_model.yaml``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pp_core.app.export.hf import (default_max_shard_size, export_record, hf_target,
                                   write_hf_files, write_model_file)
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


def export_from_run(spec, parts, output, process_group=None) -> Path:
    """Write the hand-back directory of this run's current weights into ``output``
    (collective over ``process_group``, default every rank)."""
    output = Path(output)
    record = export_record(spec)
    target = hf_target(record["model"])
    state = _local_state(parts)
    dtype = _training_dtype(spec)
    if target is not None:
        entries = [(n, n, target.shapes[n], target.dtypes[n]) for n in target.names]
        total = target.total_parameters
    else:
        entries, total = _gathered_entries(state, process_group), 0
    layout = plan_shards(entries, dtype, default_max_shard_size(), total)
    write_from_ranks(state, output, layout, process_group)
    if dist.get_rank(process_group) == 0:
        if target is not None:
            write_hf_files(output, target, dtype, record.get("data"))
        else:
            write_model_file(output, {k: v for k, v in record["model"].items()
                                      if v not in (None, {})}, "pp-core run")
    dist.barrier(group=process_group)
    return output


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
