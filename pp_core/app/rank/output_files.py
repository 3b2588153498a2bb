"""The files a run writes beside its checkpoints, and what happens when the disk refuses them.

``output.metrics`` (:class:`MetricsFile`), the trace and the schedule image
(:func:`write_output`) are records of the run, not the run: a full disk, a read-only place or a
lost permission (:mod:`pp_core.write_failures`) gets one warning naming the key and the path,
the file is left as it was before the write that failed (a metrics file cut back to its last
whole line, an image or trace never half-written: they are written beside and renamed in), and
training goes on. Any other error is raised as before.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

from pp_core.write_failures import disk_error, remove_partial, write_failure

__all__ = ["MetricsFile", "write_output"]

logger = logging.getLogger(__name__)


def _warn(key: str, path, exc: OSError, what: str) -> None:
    logger.warning("%s", write_failure(key, path, exc, what))


class MetricsFile:
    """``output.metrics``: one JSON object per line. A run that continues after ``start_step``
    keeps the lines of the steps up to it (a resumed run writes the later ones again, so every
    step appears once); a fresh run starts an empty file. Written unbuffered: a line the disk
    refuses half-way is cut back to the last whole one, and no buffered tail of it can reach the
    file later (a buffered writer flushes what it holds when it is closed)."""

    KEY = "output.metrics"

    def __init__(self, path: str | os.PathLike, start_step: int):
        self.path = Path(path)
        self.handle = None
        staging = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step and self.path.is_file():
                kept = _metrics_lines_up_to(self.path, start_step)
                staging.write_text("".join(kept), encoding="utf-8")
                os.replace(staging, self.path)
                self.handle = open(self.path, "ab", buffering=0)
            else:
                self.handle = open(self.path, "wb", buffering=0)
            self.good = self.handle.tell()
        except OSError as exc:
            remove_partial(staging)
            self._give_up(exc, "no metrics are written this run; training goes on")

    def write(self, record: dict) -> None:
        if self.handle is None:
            return
        line = memoryview((json.dumps(record) + "\n").encode("utf-8"))
        try:
            while line:  # an unbuffered write may take part of it
                line = line[self.handle.write(line):]
            self.good = self.handle.tell()
        except OSError as exc:
            self._give_up(exc, f"it keeps the lines before step {record.get('step')} and gets "
                               f"no more; training goes on")

    def _give_up(self, exc: OSError, what: str) -> None:
        if disk_error(exc) is None:
            raise exc
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                os.ftruncate(handle.fileno(), self.good)  # no torn last line
            except OSError:
                pass
            handle.close()
        _warn(self.KEY, self.path, disk_error(exc), what)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()  # unbuffered: nothing is left to write


def write_output(key: str, path: str | os.PathLike, write: Callable[[Path], None]) -> bool:
    """``write(staging)`` then rename it to ``path``; on a disk error, one warning naming ``key``
    and ``path``, nothing left behind, and ``False``."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(staging)
        os.replace(staging, path)
        return True
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is the disk
        remove_partial(staging)
        if disk_error(exc) is None:
            raise
        _warn(key, path, disk_error(exc), "it was not written; the run's result is unaffected")
        return False


def _metrics_lines_up_to(path: Path, step: int) -> list[str]:
    """The lines of a metrics file for steps ``<= step`` (a torn last line is dropped too)."""
    kept = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) \
                    and record["step"] <= step and line.endswith("\n"):
                kept.append(line)
    return kept
