"""An export is written beside its place and renamed in as a whole directory.

Every directory export (``pp-core export --format hf|safetensors -o DIR``, the PEFT adapter,
``--merge``, ``checkpoint.export_hf``) writes into ``.DIR.pp-core-export`` beside ``DIR``; only when
every file is there is the earlier ``DIR`` moved aside and the new one renamed in. So nothing of an
earlier export outlives the new one (a stale ``adapter_config.json`` would make
``from_pretrained(DIR)`` load base + the old adapter; a stale shard or index would mix two
layouts), and a disk that fills while writing leaves the earlier export as it was, with one line
naming the key and the path.

An existing ``DIR`` is replaced only when it holds nothing an export does not write
(:func:`replace_problem`): the files of a ``save_pretrained`` directory, and the ``step_N``
exports ``checkpoint.export_hf: {every: N}`` keeps inside it (those are carried over). A
directory of anything else (a home directory, a source tree) is refused before any work.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

from pp_core.errors import PipelineError, quoted
from pp_core.write_failures import disk_error, remove_partial, write_failure

__all__ = ["EXPORT_SUFFIXES", "replace_problem", "staged_directory", "staging_paths"]

EXPORT_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".yaml", ".bin",
                   ".tiktoken", ".md", ".pt")
"""What the files of a ``save_pretrained`` / PEFT / directory-form export end with."""
_STEP = re.compile(r"step_\d{8}")


def staging_paths(output: Path) -> tuple[Path, Path]:
    """Where the new export is written, and where the earlier one waits while it is renamed in."""
    return (output.parent / f".{output.name}.pp-core-export",
            output.parent / f".{output.name}.pp-core-old")


def replace_problem(key: str, path: str) -> str | None:
    """Why the existing directory ``path`` must not be replaced by an export (it holds what no
    export writes), or ``None``."""
    target = Path(os.path.expanduser(path))
    if not target.is_dir():
        return None
    try:
        entries = sorted(target.iterdir())
    except OSError:
        return None  # the writable check names it
    foreign = [p.name + ("/" if p.is_dir() else "") for p in entries
               if not (p.is_dir() and _STEP.fullmatch(p.name))
               and not (p.is_file() and p.suffix in EXPORT_SUFFIXES)
               and not p.name.startswith(".pp-core")]
    if not foreign:
        return None
    shown = ", ".join(repr(name) for name in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return (f"{key}: {quoted(path)} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'}"
            f" no export writes ({shown}); an export replaces the whole directory, so choose a "
            f"new or empty directory, or an earlier export's")


@contextlib.contextmanager
def staged_directory(output, key: str) -> Iterator[Path]:
    """Yield the empty staging directory of ``output``; when the body ends, rename it in place of
    ``output`` (the earlier export's ``step_N`` exports carried over). A disk error anywhere is
    one :class:`PipelineError` naming ``key``, the staging removed, the earlier export intact."""
    output = Path(output)
    staging, aside = staging_paths(output)
    remove_partial(staging, aside)  # what an export killed midway left
    try:
        staging.mkdir(parents=True)
        yield staging
        _rename_in(staging, aside, output)
    except BaseException as exc:
        remove_partial(staging)
        if aside.exists() and not output.exists():
            os.rename(aside, output)
        cause = disk_error(exc)
        if cause is None:
            raise
        kept = "the earlier export is intact" if output.exists() else "nothing was written"
        raise PipelineError(write_failure(key, output, cause, kept)) from None


def _rename_in(staging: Path, aside: Path, output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise PipelineError(f"{quoted(str(output))} is a file; a directory export needs a "
                            f"directory (new or existing)")
    if output.is_dir():
        os.rename(output, aside)
    os.rename(staging, output)
    if aside.is_dir():  # the earlier export's own step_N exports stay where they were
        for step in aside.iterdir():
            if step.is_dir() and _STEP.fullmatch(step.name) and not (output / step.name).exists():
                os.rename(step, output / step.name)
    remove_partial(aside)
