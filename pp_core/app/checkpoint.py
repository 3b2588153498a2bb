"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the model's own names.

A checkpoint is a DCP directory ``<dir>/step_00000100`` holding

- ``model.<name>``: every parameter and buffer under its name in the *unsplit* model (a model
  part keeps the original names, so no stage prefix ever enters the file);
- ``optim.state.<name>.<slot>`` / ``optim.param_groups.<name>.<option>``: the optimizer state,
  flattened per parameter name by ``torch.distributed.checkpoint.state_dict``;
- ``trainer.step``: the last completed step.

Because every key is a parameter name, a checkpoint written with one pipeline layout loads into
any other (pp=4 -> pp=2, or the unsplit model): each rank asks DCP for the keys its parts hold.
Parts sharded by FSDP2 / HSDP need nothing more: their parameters and optimizer moments are
DTensors, which DCP writes shard by shard under the same keys (with the whole shape) and reads
back into whatever shards or whole tensors the loading layout has (docs/composition.md).

Crash-safe: a checkpoint is written beside its final place (``step_00000100.tmp-<id>``); once
every rank has finished, rank 0 moves an existing ``step_00000100`` aside, renames the new one in,
points the ``latest`` file at it (written to a temporary file, then ``os.replace``) and only then
removes the old one. A process killed at any instant leaves the previous checkpoint of that step
intact and ``latest`` naming a complete checkpoint; leftovers (``*.tmp-*``, ``*.old-*``) are never
taken for a checkpoint. A checkpoint that is incomplete or corrupt all the same (copied in part,
truncated, a byte changed: every file's sha256, recorded while it was written, is checked at
resume, load and export - :mod:`pp_core.app.checkpoint_checksums`) is refused with one message
naming its directory. A save the disk refuses (full, read-only) is removed on every rank and
named in one line; the previous checkpoint stays.

Safe by default: a checkpoint from elsewhere is data. DCP's reader unpickles its ``.metadata``
file and ``torch.load``\\ s non-tensor items with ``weights_only=False``; here the metadata goes
through an unpickler that only admits DCP's own metadata classes and torch dtypes/sizes, and
non-tensor items load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from pp_core._torch_compat import dcp_metadata_path, set_state_dict_item
from pp_core.app.expert_state import expert_dtensors, expert_locals
from pp_core.app.checkpoint_checksums import (CHECKSUMS_FILE, files_missed, hashing_writer,
                                              manifest_text, verify_checkpoint)
from pp_core.app.checkpoint_reader import SafeLoadPlanner, SafeReader
from pp_core.errors import PipelineError
from pp_core.write_failures import disk_error, remove_partial, write_failure
from pp_core.parallel.dtensor_state import restride, unstride

__all__ = ["checkpoint_path", "latest_checkpoint", "resume_checkpoint", "save_checkpoint",
           "load_checkpoint", "read_model_state_dict", "load_into_model", "export_checkpoint", "SafeReader",
           "SafeLoadPlanner"]

_STEP_DIR = re.compile(r"step_(\d{8})$")
LATEST = "latest"
"""The file in a checkpoint directory naming the checkpoint saved last (``step_00000100``)."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``<directory>/step_<step, 8 digits>``: sorts by step as text."""
    return Path(directory) / f"step_{step:08d}"


def _complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()  # DCP writes .metadata last


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint saved last in ``directory``, or None.

    That is the one the ``latest`` file names; if a save was killed between moving the old
    checkpoint of a step aside and renaming the new one in, the old one (``step_N.old-<id>``);
    without a ``latest`` file (older directories), the complete ``step_N`` with the highest step.
    Half-written saves (``step_N.tmp-<id>``) are never returned.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    name = pointer.read_text(encoding="utf-8", errors="replace").strip() \
        if pointer.is_file() else ""
    if _STEP_DIR.match(name):
        if _complete(root / name):
            return root / name
        aside = sorted(p for p in root.glob(f"{name}.old-*") if _complete(p))
        if aside:
            return aside[-1]
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and _complete(p)]
    return max(found, key=lambda p: p.name) if found else None


def resume_checkpoint(directory, resume, verify: bool = True) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``True``: the latest in ``directory``) after
    checking that it is complete (and, with ``verify``, its checksums), or None to start fresh
    (``True`` and nothing saved yet)."""
    if not resume:
        return None
    path = (latest_checkpoint(directory) if directory else None) if resume is True \
        else Path(resume)
    if path is not None:
        _check_dir(path, verify)
    return path


# ----------------------------------------------------------------------------- checking

def _check_dir(path: Path, verify: bool = False):
    """The metadata of the checkpoint at ``path``, after checking that every file it names is
    there in full and every file's recorded size (and, with ``verify``, checksum) matches;
    otherwise one :class:`PipelineError` naming the directory."""
    if not path.exists():
        raise PipelineError(f"checkpoint {str(path)!r} does not exist; pass a step_NNNNNNNN "
                            f"directory written by pp-core run, or the checkpoint.dir holding it")
    if not (path / ".metadata").is_file():
        raise PipelineError(f"{str(path)!r} is not a complete checkpoint (no .metadata file: a "
                            f"save that was interrupted, or not a checkpoint); pass a "
                            f"step_NNNNNNNN directory written by pp-core run")
    verify_checkpoint(path, verify)  # every file as written (pp_core_checksums.json)
    try:
        metadata = SafeReader(str(path)).read_metadata()
    except PipelineError:
        raise
    except Exception as exc:  # truncated or garbled pickle: EOFError, UnpicklingError, ...
        raise _corrupt(path, f"its .metadata cannot be read ({type(exc).__name__}: "
                             f"{str(exc)[:200]})") from None
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        sizes[name] = max(sizes.get(name, 0), int(getattr(info, "offset", 0))
                          + int(getattr(info, "length", 0)))
    for name, needed in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise _corrupt(path, f"its data file {name} is missing")
        if file.stat().st_size < needed:
            raise _corrupt(path, f"its data file {name} is truncated ({file.stat().st_size} of "
                                 f"at least {needed} bytes)")
    return metadata


def _corrupt(path: Path, why: str) -> PipelineError:
    return PipelineError(f"checkpoint {str(path)!r} is incomplete or corrupt: {why}; resume or "
                         f"export from another step_NNNNNNNN directory, or delete this one")


# ----------------------------------------------------------------------------- save / load


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*assuming the intent is to",
                                    category=UserWarning)
        yield


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # lazy: DCP, seconds

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _state(parts: Iterable[nn.Module], optimizers: Iterable, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import (  # lazy: DCP, seconds
        get_model_state_dict, get_optimizer_state_dict)

    model: dict = {}
    optim: dict = {}
    for part, optimizer in zip(parts, optimizers):
        model.update(get_model_state_dict(part))
        if optimizer is not None:
            optim.update(get_optimizer_state_dict(part, optimizer, options=_options()))
    expert_dtensors(parts, model, optim)  # ep shards: whole experts in the file, any ep loads
    state = {"model": model, "optim": optim, "trainer": {"step": torch.tensor(step)}}
    return state, unstride(state)  # DCP writes no strided shard (the fused qkv): whole ones


def save_checkpoint(directory, step: int, parts, optimizers, process_group=None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Save this rank's parts and optimizers at ``<directory>/step_<step>`` (collective).

    Written beside and renamed into place (see the module docstring): a crash at any instant
    leaves the previous checkpoint intact and ``latest`` naming a complete one.
    """
    import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is written

    path = checkpoint_path(directory, step)
    distributed = dist.is_available() and dist.is_initialized()
    token = [uuid.uuid4().hex[:12]]
    if distributed:  # one staging directory for all ranks, named by rank 0
        dist.broadcast_object_list(token, group=process_group, group_src=0)
    staging = path.with_name(f"{path.name}.tmp-{token[0]}")
    writer, failed = hashing_writer(staging), None
    try:
        with _single_process_quiet():
            dcp.save(_state(parts, optimizers, step)[0], checkpoint_id=str(staging),
                     storage_writer=writer, process_group=process_group)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is one; re-raised below
        failed = exc
    mine = (writer.digests, None if failed is None else getattr(disk_error(failed), "errno", 0))
    ranks = [mine]
    if distributed:  # every rank's shards are on disk (or some rank failed): rank 0 learns both
        ranks = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(ranks, mine, group=process_group)
    error = [None]
    if not distributed or dist.get_rank(process_group) == 0:
        error[0] = _finish_save(staging, path, token[0], ranks, extra_files)
    if distributed:  # nobody reads or saves again before it is in place
        dist.broadcast_object_list(error, group=process_group, group_src=0)
    if failed is not None and not mine[1]:
        raise failed  # not the disk: a fault of its own, with its traceback
    if error[0] is not None:
        raise PipelineError(error[0]) from None
    return path


def _finish_save(staging: Path, path: Path, token: str, ranks, extra_files) -> str | None:
    """On rank 0: the checksums and extra files written and the checkpoint published; or, when
    a rank failed or the disk refuses, ``staging`` removed and the one line every rank raises."""
    errnos = [code for _, code in ranks if code is not None]
    try:
        if not errnos:
            digests = {name: d for found, _ in ranks for name, d in found.items()}
            digests.update(files_missed(staging, digests))  # a torch writing past the hook
            for name, text in {**(extra_files or {}), CHECKSUMS_FILE: manifest_text(
                    digests, extra_files)}.items():  # e.g. what it was written for
                (staging / name).write_text(text, encoding="utf-8")
            _publish(staging, path, token)
            return None
    except OSError as exc:
        if disk_error(exc) is None:
            remove_partial(staging, path.parent / f".{LATEST}.tmp-{token}")
            raise
        errnos = [exc.errno]
    remove_partial(staging, path.parent / f".{LATEST}.tmp-{token}")
    latest = latest_checkpoint(path.parent)
    kept = f"the last good checkpoint {str(latest)!r} is intact" if latest else \
        "there is no earlier checkpoint"
    code = next((c for c in errnos if c), None)
    if code is None:
        return f"checkpoint {str(path)!r} was not saved: a rank failed while writing it; {kept}"
    return write_failure("checkpoint.dir", path, OSError(code, os.strerror(code)),
                         f"the partial save was removed and {kept}")


def _publish(staging: Path, path: Path, token: str) -> None:
    """Rename the finished ``staging`` checkpoint to ``path``, point ``latest`` at it, then drop
    the checkpoint it replaces and the leftovers of earlier saves of this step that were killed."""
    aside = path.with_name(f"{path.name}.old-{token}")
    if path.exists():
        os.rename(path, aside)
    os.rename(staging, path)
    pointer = path.parent / f".{LATEST}.tmp-{token}"
    with open(pointer, "w", encoding="utf-8") as fh:
        fh.write(path.name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(pointer, path.parent / LATEST)
    for leftover in [aside, *path.parent.glob(f"{path.name}.tmp-*"),
                     *path.parent.glob(f"{path.name}.old-*")]:
        if leftover.is_dir():
            (leftover / ".metadata").unlink(missing_ok=True)  # never complete-looking again
            shutil.rmtree(leftover, ignore_errors=True)


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
    _check_dir(path, verify)
    state, strided = _state(parts, optimizers, 0)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeReader(str(path)),
                     planner=SafeLoadPlanner(), process_group=process_group)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        cause = _cause(exc)
        if _is_damage(cause):
            raise _corrupt(path, f"{type(cause).__name__}: {str(cause)[:200]}") from None
        raise PipelineError(
            f"cannot load checkpoint {str(path)!r} into this pipeline: {type(cause).__name__}: "
            f"{str(cause)[:300]}; was it written for this model (model.args)?") from None
    restride(state, strided)
    expert_locals(state)
    for part, optimizer in zip(parts, optimizers):
        names = set(part.state_dict().keys())
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in names})
        if optimizer is not None:
            set_optimizer_state_dict(part, optimizer, state["optim"], options=_options())
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
    metadata = _check_dir(path, verify)
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                     no_dist=True)
    except PipelineError:
        raise
    except (Exception, CheckpointException) as exc:
        cause = _cause(exc)
        raise _corrupt(path, f"{type(cause).__name__}: {str(cause)[:200]}") from None
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
