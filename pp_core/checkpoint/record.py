"""What a checkpoint says about itself: the one module that knows the names of its side-files.

Beside DCP's own files (``.metadata``, ``__<rank>_0.distcp``) a checkpoint ``step_NNNNNNNN``
holds two files of pp-core's, and its directory (``checkpoint.dir``) one:

* ``pp_core_record.json``, the record: one JSON object whose sections the application fills
  with plain values when it saves (the library never reads a spec)::

      {"version": 1, "checksums": "pp_core_checksums.json", "promises_checksums": true,
       "run": {"model": {...}, "optimizer": "AdamW", "layout": {...}},
       "export": {"model": {...}, "data": {...}}}

  ``run`` is what the checkpoint was trained for (the resume check compares it with the
  pipeline file), ``export`` what an export needs on its own (the model and data sections, the
  training dtype, and what describes an HF model: :mod:`pp_core.app.export.described`). Every
  pp-core that writes a record writes the checksums too (``promises_checksums``), so a record
  without its list is refused (:func:`promises_checksums`), as is an earlier release's
  ``pp_core_export.json`` without one (that release wrote both).
* ``pp_core_checksums.json``: every file's size and sha256, the record's included
  (:mod:`pp_core.checkpoint.checksums`); written after the record, so it is a file of its own.
* ``latest`` in the directory: the name of the checkpoint saved last, written to a temporary
  file and renamed over the old one (:func:`point_latest`), so it always names a complete one.

Checkpoints of earlier pp-core releases kept each section in a file of its own
(``pp_core_run.json``, ``pp_core_export.json``); they are read as they were written, so they
still load, resume and export.

Where what a checkpoint says about itself grows: a new kind of reader is one more section
(:data:`SECTIONS`), and a richer description is more keys of one (the export's description of
the model taken at save time: ``export``); "latest complete" is decided by :func:`point_latest`,
the one writer of the pointer (an asynchronous save calls it once every rank's files and
checksums are durable), and the state of a save still being written is one more name here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping

from pp_core.errors import PipelineError, shorten

__all__ = ["RECORD_FILE", "CHECKSUMS_FILE", "LATEST", "SECTIONS", "RecordError",
           "corrupt", "record_files", "read_section", "promises_checksums", "latest_name",
           "point_latest", "pointer_staging"]

RECORD_FILE = "pp_core_record.json"
CHECKSUMS_FILE = "pp_core_checksums.json"
LATEST = "latest"
VERSION = 1
SECTIONS = {"run": "pp_core_run.json", "export": "pp_core_export.json"}
"""Each section of the record, and the file an earlier pp-core kept it in."""


def corrupt(path: str | os.PathLike, why: str, checked: bool = False) -> PipelineError:
    """The one refusal of a checkpoint that is incomplete or corrupt, naming its directory;
    ``checked``: found by the checksums, which ``checkpoint.verify: false`` skips."""
    skip = (" (checkpoint.verify: false, or export --no-verify, skips this check)" if checked
            else "")
    return PipelineError(f"checkpoint {str(path)!r} is incomplete or corrupt: {why}; resume or "
                         f"export from another step_NNNNNNNN directory, or delete this one{skip}")


class RecordError(PipelineError):
    """A record that is there and cannot be read: the ``file`` and ``why``."""

    def __init__(self, file: Path, why: str):
        self.file, self.why = file, why
        super().__init__(str(corrupt(file.parent, f"its {file.name} is malformed ({why})")))


def record_files(sections: Mapping[str, dict] | None) -> dict[str, str]:
    """``{file name: text}`` a save writes beside DCP's files: the record holding ``sections``
    (``{name: JSON-able dict}``, names from :data:`SECTIONS`)."""
    sections = dict(sections or {})
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown checkpoint record section(s) {unknown}; known: "
                         f"{sorted(SECTIONS)}")
    record = {"version": VERSION, "checksums": CHECKSUMS_FILE, "promises_checksums": True,
              **sections}
    return {RECORD_FILE: json.dumps(record, default=str, indent=1) + "\n"}


def _json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise RecordError(file, f"{type(exc).__name__}: {shorten(str(exc), 120)}") from None


def read_section(path: str | os.PathLike, name: str,
                 check: Callable[[object], str | None] | None = None) -> dict | None:
    """The section ``name`` of the checkpoint at ``path`` (from its record, else from the file
    an earlier pp-core kept it in), or None when it has none.

    A file that is there but cannot be read, or a section ``check`` finds fault with (it returns
    what is wrong, or None), is a :class:`RecordError` naming the file."""
    path = Path(path)
    file, record = path / RECORD_FILE, {}
    if file.exists():
        record = _json(file)
        if not isinstance(record, dict):
            raise RecordError(file, f"a JSON object expected, found {type(record).__name__}")
    if name in record:
        value, where = record[name], f"its '{name}' section: "
    else:
        file = path / SECTIONS.get(name, RECORD_FILE)
        if name not in SECTIONS or not file.exists():
            return None
        value, where = _json(file), ""
    why = check(value) if check is not None else (
        None if isinstance(value, dict) else f"a JSON object expected, found "
                                             f"{type(value).__name__}")
    if why is not None:
        raise RecordError(file, where + why)
    return value


def promises_checksums(path: str | os.PathLike) -> str | None:
    """The file of the checkpoint at ``path`` that says a checksums list was written (deleting
    or garbling the list, or dropping the file that names it, must not switch the check off),
    or None (an older pp-core's): the record (every pp-core that writes one writes the list and
    says so, ``promises_checksums``), an earlier release's ``pp_core_run.json`` naming the list,
    or its ``pp_core_export.json`` (the releases that wrote it wrote the list)."""
    path = Path(path)
    if (path / RECORD_FILE).exists():
        return RECORD_FILE
    run = path / SECTIONS["run"]
    try:
        if CHECKSUMS_FILE in run.read_text(encoding="utf-8"):
            return run.name
    except (OSError, ValueError):
        pass
    return SECTIONS["export"] if (path / SECTIONS["export"]).exists() else None


def latest_name(directory: str | os.PathLike) -> str:
    """What ``latest`` in ``directory`` names (``step_00000100``), or ``""``."""
    pointer = Path(directory) / LATEST
    return pointer.read_text(encoding="utf-8", errors="replace").strip() \
        if pointer.is_file() else ""


def pointer_staging(directory: str | os.PathLike, token: str) -> Path:
    """Where :func:`point_latest` writes the pointer before renaming it into place."""
    return Path(directory) / f".{LATEST}.tmp-{token}"


def point_latest(directory: str | os.PathLike, name: str, token: str) -> None:
    """Point ``latest`` in ``directory`` at the checkpoint ``name``: written to a temporary file,
    synced, and renamed over the old pointer, so it names one checkpoint or the other."""
    staging = pointer_staging(directory, token)
    with open(staging, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staging, Path(directory) / LATEST)
