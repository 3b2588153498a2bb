"""Reading a checkpoint without trusting it: DCP's ``.metadata`` through an unpickler that admits
only DCP's own metadata classes and torch dtypes/sizes, non-tensor items with ``weights_only=True``
(used by :mod:`pp_core.checkpoint`)."""

from __future__ import annotations

import enum
import io
import pickle

import torch

from pp_core._torch_compat import dcp_metadata_path, set_state_dict_item
from pp_core.errors import PipelineError

__all__ = ["SafeReader", "SafeLoadPlanner"]

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
    from torch.distributed.checkpoint import FileSystemReader  # lazy: DCP, seconds
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
