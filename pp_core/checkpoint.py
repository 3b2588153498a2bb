"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the model's own names.

A checkpoint is a DCP directory ``<dir>/step_00000100`` holding

- ``model.<name>``: every parameter and buffer under its name in the *unsplit* model (a model
  part keeps the original names, so no stage prefix ever enters the file);
- ``optim.state.<name>.<slot>`` / ``optim.param_groups.<name>.<option>``: the optimizer state,
  flattened per parameter name by ``torch.distributed.checkpoint.state_dict``;
- ``trainer.step``: the last completed step.

Because every key is a parameter name, a checkpoint written with one pipeline layout loads into
any other (pp=4 -> pp=2, or the unsplit model): each rank asks DCP for the keys its parts hold.

Safe by default: a checkpoint from elsewhere is data. DCP's reader unpickles its ``.metadata``
file and ``torch.load``\\ s non-tensor items with ``weights_only=False``; here the metadata goes
through an unpickler that only admits DCP's own metadata classes and torch dtypes/sizes, and
non-tensor items load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from pp_core._torch_compat import dcp_metadata_path, set_state_dict_item
from pp_core.errors import PipelineError

__all__ = ["checkpoint_path", "latest_checkpoint", "save_checkpoint", "load_checkpoint",
           "read_model_state_dict", "load_into_model", "export_checkpoint", "SafeReader",
           "SafeLoadPlanner"]

_STEP_DIR = re.compile(r"step_(\d{8})$")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``<directory>/step_<step, 8 digits>``: sorts by step as text."""
    return Path(directory) / f"step_{step:08d}"


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step (DCP writes ``.metadata`` last), or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return max(found, key=lambda p: p.name) if found else None


# ----------------------------------------------------------------------------- safe reading

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint.planner")
_ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
            ("pathlib", "Path"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("builtins", "slice")}


def _enum_member(cls, name: str):
    """``getattr(cls, name)`` for an enum member only: how Python 3.11.0 to 3.11.x (Debian 12's
    3.11.2 among them) pickle enum members, such as those in DCP's metadata."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise PipelineError(f"checkpoint metadata calls getattr({cls!r}, {name!r}); pp-core only "
                        f"admits it for a member of one of DCP's enums, so it refuses this file")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP metadata classes, torch dtypes/sizes/layouts and plain containers, nothing else."""

    def find_class(self, module: str, name: str):
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _enum_member  # its arguments went through find_class too
        allowed = (module, name) in _ALLOWED or (
            module in _ALLOWED_MODULES and isinstance(
                getattr(__import__(module, fromlist=[name]), name, None), type))
        if module == "torch" and isinstance(getattr(torch, name, None),
                                             (torch.dtype, torch.layout, torch.memory_format)):
            allowed = True
        if not allowed:
            raise PipelineError(
                f"checkpoint metadata refers to {module}.{name}; pp-core loads checkpoints "
                f"without unpickling arbitrary objects, so it refuses this file (only DCP's own "
                f"metadata classes and torch dtypes are allowed)")
        return super().find_class(module, name)


def _reader_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """A FileSystemReader whose metadata is read by :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args, **kwargs):
            path = dcp_metadata_path(self, kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Loads non-tensor items (optimizer hyper-parameters, ints) with ``weights_only=True``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_state_dict_item(self.original_state_dict,
                                    self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafeLoadPlanner


SafeReader, SafeLoadPlanner = _reader_classes()


def _check_dir(path: Path) -> None:
    if not (path / ".metadata").is_file():
        raise PipelineError(f"{str(path)!r} is not a complete checkpoint (no .metadata file); "
                            f"pass a step_NNNNNNNN directory written by pp-core run")


# ----------------------------------------------------------------------------- save / load


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*assuming the intent is to",
                                    category=UserWarning)
        yield


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _state(parts: Iterable[nn.Module], optimizers: Iterable, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model: dict = {}
    optim: dict = {}
    for part, optimizer in zip(parts, optimizers):
        model.update(get_model_state_dict(part))
        if optimizer is not None:
            optim.update(get_optimizer_state_dict(part, optimizer, options=_options()))
    return {"model": model, "optim": optim, "trainer": {"step": torch.tensor(step)}}


def save_checkpoint(directory, step: int, parts, optimizers, process_group=None) -> Path:
    """Save this rank's parts and optimizers at ``<directory>/step_<step>`` (collective)."""
    import torch.distributed.checkpoint as dcp

    path = checkpoint_path(directory, step)
    with _single_process_quiet():
        dcp.save(_state(parts, optimizers, step), checkpoint_id=str(path),
                 process_group=process_group)
    return path


def load_checkpoint(path, parts, optimizers, process_group=None) -> int:
    """Load the keys this rank's parts and optimizers hold; returns the checkpoint's step.

    Works whatever pipeline layout wrote the checkpoint: the keys are parameter names.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    _check_dir(path)
    state = _state(parts, optimizers, 0)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner(), process_group=process_group)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()), exc)
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, stack)
        raise PipelineError(
            f"cannot load checkpoint {str(path)!r} into this pipeline: {type(cause).__name__}: "
            f"{cause}; was it written for this model (model.args)?") from None
    for part, optimizer in zip(parts, optimizers):
        names = set(part.state_dict().keys())
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names})
        if optimizer is not None:
            set_optimizer_state_dict(part, optimizer, state["optim"], options=_options())
    return int(state["trainer"]["step"])


def read_model_state_dict(path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a checkpoint, under its original name, on the CPU (no PG)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    _check_dir(path)
    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with _single_process_quiet():
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                 no_dist=True)
    return {key[len("model."):]: value for key, value in state.items()}


def load_into_model(path, model: nn.Module, strict: bool = True):
    """Load a checkpoint's weights into an unsplit model (any pipeline layout wrote it)."""
    return model.load_state_dict(read_model_state_dict(path), strict=strict)


def export_checkpoint(path, output) -> Path:
    """Write a checkpoint's weights as one ``state_dict`` file: ``.safetensors`` or torch ``.pt``."""
    output = Path(output)
    state = read_model_state_dict(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise PipelineError("writing .safetensors needs the safetensors package; "
                                "pip install safetensors, or export to a .pt file") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(output))
    else:
        torch.save(state, output)
    return output
