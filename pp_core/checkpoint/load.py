"""Reading a checkpoint back: into this rank's parts and optimizers at any layout, as tensors on
the CPU (:func:`read_tensors`, the one reader of exports), or exported to a single
``.safetensors`` / ``.pt`` file.

Every read checks the directory first (:func:`~pp_core.checkpoint.directory.check_dir`: whole,
and with ``verify`` its checksums, once per command) and goes through the safe reader
(:mod:`pp_core.checkpoint.safe_reader`) in :func:`_dcp_read`, the one place DCP reads: a
checkpoint is data.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from pp_core.checkpoint.directory import check_dir
from pp_core.checkpoint.expert_state import expert_locals
from pp_core.checkpoint.record import corrupt
from pp_core.checkpoint.safe_reader import SafeLoadPlanner, SafeReader
from pp_core.checkpoint.state import (flat_optimizer_options, restore_rng, single_process_quiet,
                                      state_dicts)
from pp_core.errors import PipelineError
from pp_core.parallel.dtensor_state import restride
from pp_core.write_failures import disk_error, remove_partial, write_failure


def _dcp_read(path: Path, state: dict, process_group=None, distributed: bool = True) -> None:
    """DCP's load of ``state`` from the checkpoint at ``path`` through the safe reader (a
    collective over ``process_group``, or this process alone without ``distributed``, which
    asks for what the metadata lists); a failure is one line: damaged files, or a checkpoint of
    another model."""
    import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is read
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner(), process_group=process_group,
                     no_dist=not distributed)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = _cause(exc)
        if _is_damage(cause) or not distributed:
            raise corrupt(path, f"{type(cause).__name__}: {str(cause)[:200]}") from None
        raise PipelineError(
            f"cannot load checkpoint {str(path)!r} into this pipeline: {type(cause).__name__}: "
            f"{str(cause)[:300]}; was it written for this model (model.args)?") from None


def load_checkpoint(path, parts, optimizers, process_group=None, verify: bool = True) -> int:
    """Load the keys this rank's parts and optimizers hold; returns the checkpoint's step.

    Works whatever pipeline layout wrote the checkpoint: the keys are parameter names. With
    ``verify``, every file is checked against its recorded checksum first.
    """
    from torch.distributed.checkpoint.state_dict import (  # lazy: DCP, only when one is read
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    stored = check_dir(path, verify).state_dict_metadata
    state, strided = state_dicts(parts, optimizers, 0)
    restore_rng(state, stored)  # an older checkpoint, or another world: the generators as seeded
    _dcp_read(path, state, process_group)
    restore_rng(state, None)
    restride(state, strided)
    expert_locals(state)
    for part, optimizer in zip(parts, optimizers):
        names = set(part.state_dict().keys())
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names})
        if optimizer is not None:
            set_optimizer_state_dict(part, optimizer, state["optim"],
                                     options=flat_optimizer_options())
    return int(state["trainer"]["step"])


def _cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException``, else ``exc``."""
    failures = getattr(exc, "failures", None) or {}
    cause = next(iter(failures.values()), exc)
    return cause[0] if isinstance(cause, tuple) else cause  # (exception, stack)


def _is_damage(cause: BaseException) -> bool:
    """Whether a load failed on the files (missing, short, garbled), not on the model's keys."""
    return isinstance(cause, (OSError, EOFError, pickle.UnpicklingError)) or any(
        text in str(cause)
        for text in ("PytorchStreamReader", "unexpected EOF", "invalid load key"))


def read_tensors(path, names: Iterable[str], verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint at ``path`` (its keys: ``model.<name>`` for the
    weights, whole whatever layout wrote them), on the CPU, without a process group.

    The checkpoint is checked first (whole; with ``verify``, its checksums: once per command,
    a later read checks sizes only); a name it lacks is one line naming the first few."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP

    path = Path(path)
    stored = check_dir(path, verify).state_dict_metadata
    names = list(names)
    missing = [n for n in names if not isinstance(stored.get(n), TensorStorageMetadata)]
    if missing:
        raise PipelineError(f"checkpoint {str(path)!r} lacks {len(missing)} tensor(s) asked "
                            f"for ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                            f"; was it written for this model (model.args)?")
    state = {n: torch.empty(stored[n].size, dtype=stored[n].properties.dtype) for n in names}
    _dcp_read(path, state, distributed=False)
    return state


def read_model_state_dict(path, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a checkpoint, under its original name, on the CPU (no PG);
    ``verify``: its files checked against their recorded checksums first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: DCP

    stored = check_dir(Path(path), verify).state_dict_metadata
    keys = [k for k, meta in stored.items()
            if k.startswith("model.") and isinstance(meta, TensorStorageMetadata)]
    return {key[len("model."):]: value for key, value in read_tensors(path, keys, verify).items()}


def load_into_model(path, model: nn.Module, strict: bool = True, verify: bool = True):
    """Load a checkpoint's weights into an unsplit model (any pipeline layout wrote it)."""
    return model.load_state_dict(read_model_state_dict(path, verify), strict=strict)


def export_checkpoint(path, output, verify: bool = True) -> Path:
    """Write a checkpoint's weights as one ``state_dict`` file: ``.safetensors`` or torch ``.pt``
    (written beside and renamed into place: a failed export leaves no partial file)."""
    output = Path(output)
    state = read_model_state_dict(path, verify)
    if output.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file  # lazy: safetensors, only for an export
        except ImportError:
            raise PipelineError("writing .safetensors needs the safetensors package; "
                                "pip install safetensors, or export to a .pt file") from None
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if output.suffix == ".safetensors":
            save_file({k: v.contiguous() for k, v in state.items()}, str(staging))
        else:
            with open(staging, "wb") as handle:  # a Python file: a full disk is an OSError
                torch.save(state, handle)
        os.replace(staging, output)
    except Exception as exc:  # torch's and safetensors' writers wrap the OSError
        remove_partial(staging)
        cause = disk_error(exc) or (exc if isinstance(exc, OSError) else None)
        if cause is None:
            raise
        raise PipelineError(write_failure("-o", output, cause, "nothing was written")
                            if disk_error(exc) else f"cannot write {str(output)!r}: "
                            f"{cause.strerror or cause}") from None
    return output
