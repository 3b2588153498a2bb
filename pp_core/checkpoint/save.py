"""Saving a checkpoint crash-safe: written beside its final place, checksummed, renamed in.

Every rank writes its shards into one staging directory ``step_N.tmp-<id>``; rank 0 adds the
record and the checksums (:mod:`pp_core.checkpoint.record`) and publishes it (the order is in
:mod:`pp_core.checkpoint`). A save the disk refuses is removed on every rank and named in one
line; the previous checkpoint stays.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist

from pp_core.checkpoint.checksums import files_missed, hashing_writer, manifest_text
from pp_core.checkpoint.directory import checkpoint_path, latest_checkpoint
from pp_core.checkpoint.record import (CHECKSUMS_FILE, point_latest, pointer_staging,
                                       record_files)
from pp_core.checkpoint.state import single_process_quiet, state_dicts
from pp_core.errors import PipelineError
from pp_core.write_failures import disk_error, remove_partial, write_failure


def save_checkpoint(directory, step: int, parts, optimizers, process_group=None,
                    record: dict[str, dict] | None = None) -> Path:
    """Save this rank's parts and optimizers at ``<directory>/step_<step>`` (collective).

    ``record``: the sections of the checkpoint's record (``{"run": {...}, "export": {...}}``,
    plain values: :mod:`pp_core.checkpoint.record`), as rank 0 passes them. Written beside and
    renamed into place (see the module docstring): a crash at any instant leaves the previous
    checkpoint intact and ``latest`` naming a complete one.
    """
    import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is written

    path, files = checkpoint_path(directory, step), record_files(record)  # checked on every rank
    staging, token = staging_path(path, process_group)
    writer, failed = hashing_writer(staging), None
    try:
        with single_process_quiet():
            dcp.save(state_dicts(parts, optimizers, step)[0], checkpoint_id=str(staging),
                     storage_writer=writer, process_group=process_group)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is one; re-raised below
        failed = exc
    error = publish_everywhere(writer, failed, staging, path, token, files, process_group)
    if error is not None:
        raise error
    return path


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def staging_path(path: Path, process_group=None, token: str | None = None) -> tuple[Path, str]:
    """``(staging directory, token)`` of a save of ``path`` (collective): one staging directory
    for all ranks, named by rank 0 - or by ``token``, which every rank already agrees on (then
    nothing is sent)."""
    if token is not None:
        return path.with_name(f"{path.name}.tmp-{token}"), token
    return staging_path(path, token=agreed_token(process_group))


def agreed_token(process_group=None) -> str:
    """A random name rank 0 draws and every rank learns (collective)."""
    token = [uuid.uuid4().hex[:12]]
    if _distributed():
        dist.broadcast_object_list(token, group=process_group, group_src=0)
    return token[0]


def publish_everywhere(writer, failed, staging: Path, path: Path, token: str, files,
                       process_group=None) -> BaseException | None:
    """After this rank's DCP write (``failed``: its exception, or None), collectively: rank 0
    learns every rank's digests and disk errors, writes the record and the checksums and
    publishes (:func:`_finish_save`), and every rank learns the outcome before anyone reads or
    saves again. Returns what this rank raises: its own fault when it is not the disk's (with its
    traceback), else the one line of a failed save, else None."""
    distributed = _distributed()
    mine = (writer.digests, None if failed is None else getattr(disk_error(failed), "errno", 0))
    ranks = [mine]
    if distributed:  # every rank's shards are on disk (or some rank failed): rank 0 learns both
        ranks = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(ranks, mine, group=process_group)
    error = [None]
    if not distributed or dist.get_rank(process_group) == 0:
        error[0] = _finish_save(staging, path, token, ranks, files)
    if distributed:  # nobody reads or saves again before it is in place
        dist.broadcast_object_list(error, group=process_group, group_src=0)
    if failed is not None and not mine[1]:
        return failed
    return None if error[0] is None else PipelineError(error[0])


def _finish_save(staging: Path, path: Path, token: str, ranks, files) -> str | None:
    """On rank 0: the record and the checksums written and the checkpoint published; or, when
    a rank failed or the disk refuses, ``staging`` removed and the one line every rank raises."""
    errnos = [code for _, code in ranks if code is not None]
    try:
        if not errnos:
            digests = {name: d for found, _ in ranks for name, d in found.items()}
            digests.update(files_missed(staging, digests))  # a torch writing past the hook
            for name, text in {**files, CHECKSUMS_FILE: manifest_text(
                    digests, files)}.items():  # the record, then the list of every file
                (staging / name).write_text(text, encoding="utf-8")
            _publish(staging, path, token)
            return None
    except OSError as exc:
        if disk_error(exc) is None:
            remove_partial(staging, pointer_staging(path.parent, token))
            raise
        errnos = [exc.errno]
    remove_partial(staging, pointer_staging(path.parent, token))
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
    point_latest(path.parent, path.name, token)
    for leftover in [aside, *path.parent.glob(f"{path.name}.tmp-*"),
                     *path.parent.glob(f"{path.name}.old-*")]:
        if leftover.is_dir():
            (leftover / ".metadata").unlink(missing_ok=True)  # never complete-looking again
            shutil.rmtree(leftover, ignore_errors=True)
