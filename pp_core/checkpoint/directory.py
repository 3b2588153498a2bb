"""Where a checkpoint is in its directory, and whether one is whole before anything reads it.

A save writes ``step_N.tmp-<id>`` and renames it into place, keeping ``step_N.old-<id>`` aside
until ``latest`` names the new one (:mod:`pp_core.checkpoint.save`); the functions here find the
checkpoint saved last among those, and refuse one that is incomplete or corrupt in one line naming
its directory, before DCP is asked to read it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pp_core.checkpoint.checksums import check_listed, verify_checkpoint
from pp_core.checkpoint.record import corrupt, latest_name
from pp_core.checkpoint.safe_reader import SafeReader
from pp_core.errors import PipelineError

_STEP_DIR = re.compile(r"step_(\d{8})$")


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
    name = latest_name(root)
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
        check_dir(path, verify)
    return path


def check_dir(path: Path, verify: bool = False):
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
    verify_checkpoint(path, verify)  # every file as written (its recorded checksums)
    try:
        metadata = SafeReader(str(path)).read_metadata()
    except PipelineError:
        raise
    except Exception as exc:  # truncated or garbled pickle: EOFError, UnpicklingError, ...
        raise corrupt(path, f"its .metadata cannot be read ({type(exc).__name__}: "
                             f"{str(exc)[:200]})") from None
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        sizes[name] = max(sizes.get(name, 0), int(getattr(info, "offset", 0))
                          + int(getattr(info, "length", 0)))
    check_listed(path, sizes, verify)  # no file DCP reads is left out of the list
    for name, needed in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise corrupt(path, f"its data file {name} is missing")
        if file.stat().st_size < needed:
            raise corrupt(path, f"its data file {name} is truncated ({file.stat().st_size} of "
                                 f"at least {needed} bytes)")
    return metadata

