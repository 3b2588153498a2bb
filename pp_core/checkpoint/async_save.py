"""Saving without stopping: ``checkpoint.async: true`` through DCP's own ``async_save``.

:meth:`AsyncSaver.save` stages this rank's state to host memory (DCP's ``DefaultStager``,
kept across saves, so that every save after the first copies into the host buffers of the last
instead of allocating new ones: :func:`_stager`) and returns; DCP's thread writes the files
through the same hashing writer as a synchronous save (:mod:`pp_core.checkpoint.checksums`: the
checksums are computed on the way to the disk, off the training path), over a gloo group of its
own (so its collectives never interleave with training's). A second thread of ours then waits
for the write, gathers every rank's digests over that group, and on rank 0 writes the record and
the checksums and publishes the checkpoint exactly as a synchronous save does
(:func:`pp_core.checkpoint.save.publish_everywhere`): ``latest`` moves only once every rank's
files and the checksums are on disk, so a crash during a background write leaves the previous
checkpoint as the one to resume from. Nothing is sent in the step: the group and the name of the
attempt's staging directories are agreed once, when the saver is made.

At most one save is in flight: a new one first waits for the last (:meth:`AsyncSaver.wait`
returns how long it waited, which the run reports), and the run waits for the last one before
it ends. A background save that failed raises its one-line error at the next wait or poll.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pp_core.checkpoint.checksums import hashing_writer
from pp_core.checkpoint.directory import checkpoint_path
from pp_core.checkpoint.record import record_files
from pp_core.checkpoint.save import agreed_token, publish_everywhere, staging_path
from pp_core.checkpoint.state import single_process_quiet, state_dicts
from pp_core.parallel.dims import background_group

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """This rank's background saves, one at a time (every rank makes one and saves alike)."""

    def __init__(self):
        """Collective, once, before the first step: the gloo group DCP's thread and ours talk
        over, and the name of this attempt's saves, so that a save sends nothing before its
        staging (a staging directory is ``step_N.tmp-<name><N>``: no attempt reuses another's,
        torn, one)."""
        distributed = dist.is_available() and dist.is_initialized()
        self.group = background_group() if distributed else None
        self.name = agreed_token(self.group)[:8]
        self.thread: threading.Thread | None = None
        self.outcome: tuple | None = None  # (step, path, error, seconds writing)
        self.stager = None  # DCP's DefaultStager, kept: its host copies are reused (_stager)

    def save(self, directory, step: int, parts, optimizers,
             record: dict[str, dict] | None = None) -> tuple[float, float, tuple | None]:
        """Start saving at ``<directory>/step_<step>`` (collective); returns the seconds waited
        for the previous save, the seconds this call blocked (staging to host memory), and the
        previous save's ``(step, path, seconds writing)`` if this call saw it finish."""
        import torch.distributed.checkpoint as dcp  # lazy: DCP, only when a checkpoint is written

        waited, finished = self.wait()
        began = time.perf_counter()
        path, files = checkpoint_path(directory, step), record_files(record)
        staging, token = staging_path(path, token=f"{self.name}{step:x}")
        writer = hashing_writer(staging)
        if self.stager is None:
            self.stager = _stager()
        with single_process_quiet():
            future = dcp.async_save(state_dicts(parts, optimizers, step)[0],
                                    checkpoint_id=str(staging), storage_writer=writer,
                                    process_group=self.group, async_stager=self.stager)
        blocked = time.perf_counter() - began
        self.thread = threading.Thread(
            target=self._finish, args=(future, writer, staging, path, token, files, step),
            name="pp-core checkpoint", daemon=True)
        self.thread.start()
        return waited, blocked, finished

    def _finish(self, future, writer, staging: Path, path: Path, token: str, files,
                step: int) -> None:
        """In the background: wait for DCP's write, then publish as a synchronous save does."""
        began, failed, error = time.perf_counter(), None, None
        try:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - reported by wait()
                failed = exc
            error = publish_everywhere(writer, failed, staging, path, token, files, self.group)
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            error = exc
        self.outcome = (step, path, error, time.perf_counter() - began)

    def poll(self) -> tuple | None:
        """``(step, path, seconds writing)`` of a background save that has just finished, once;
        raises its error if it failed."""
        if self.thread is None or self.thread.is_alive():
            return None
        return self._collect()

    def wait(self) -> tuple[float, tuple | None]:
        """Wait for the save in flight (if any): the seconds waited and its ``(step, path,
        seconds writing)``. A failed one raises."""
        if self.thread is None:
            return 0.0, None
        began = time.perf_counter()
        self.thread.join()
        return time.perf_counter() - began, self._collect()

    def close(self) -> None:
        """The run's end, after :meth:`wait`: the stager's host copies are let go."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _collect(self) -> tuple:
        self.thread = None
        step, path, error, seconds = self.outcome
        self.outcome = None
        if error is not None:
            raise error
        return step, path, seconds


def _stager():
    """DCP's own stager, kept across saves: it keeps the host copy of each tensor storage it
    staged (keyed by the storage, which parameters and optimizer state keep across steps) and
    copies into it the next time, so a save after the first allocates nothing. Safe because at
    most one save is in flight (:meth:`AsyncSaver.save` waits for the last first). Pinned (and
    copied without blocking) where there is a GPU to copy from."""
    from torch.distributed.checkpoint.staging import (  # lazy: DCP, as in save()
        DefaultStager, StagingOptions)

    gpu = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=gpu))
