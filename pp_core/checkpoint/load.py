"""Reading a checkpoint back: into this rank's parts and optimizers at any layout, as one
unsplit ``state_dict`` on the CPU, or exported to a single ``.safetensors`` / ``.pt`` file.

Every read checks the directory first (:func:`~pp_core.checkpoint.directory.check_dir`) and goes
through the safe reader (:mod:`pp_core.checkpoint.safe_reader`): a checkpoint is data.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from torch import nn

from pp_core.checkpoint.directory import check_dir, corrupt
from pp_core.checkpoint.expert_state import expert_locals
from pp_core.checkpoint.safe_reader import SafeLoadPlanner, SafeReader
from pp_core.checkpoint.state import flat_optimizer_options, single_process_quiet, state_dicts
from pp_core.errors import PipelineError
from pp_core.parallel.dtensor_state import restride
from pp_core.write_failures import disk_error, remove_partial, write_failure


def load_checkpoint(path, parts, optimizers, process_group=None, verify: bool = True) -> int:
    """Load the keys this rank's parts and optimizers hold; returns the checkpoint's step.

    Works whatever pipeline layout wrote the checkpoint: the keys are parameter names. With
    ``verify``, every file is checked against its recorded checksum first.
    """
    import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is read
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    check_dir(path, verify)
    state, strided = state_dicts(parts, optimizers, 0)
    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner(), process_group=process_group)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = _cause(exc)
        if _is_damage(cause):
            raise corrupt(path, f"{type(cause).__name__}: {str(cause)[:200]}") from None
        raise PipelineError(
            f"cannot load checkpoint {str(path)!r} into this pipeline: {type(cause).__name__}: "
            f"{str(cause)[:300]}; was it written for this model (model.args)?") from None
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


def read_model_state_dict(path, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a checkpoint, under its original name, on the CPU (no PG);
    ``verify``: its files checked against their recorded checksums first."""
    import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is exported
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    metadata = check_dir(path, verify)
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                     no_dist=True)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:
        cause = _cause(exc)
        raise corrupt(path, f"{type(cause).__name__}: {str(cause)[:200]}") from None
    return {key[len("model."):]: value for key, value in state.items()}


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
