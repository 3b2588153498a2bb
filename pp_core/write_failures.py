"""One way for every writer to fail on the disk: a full device, a read-only place, no permission.

The metrics sink, TensorBoard, the trace, checkpoints, ``export`` and the token cache all write
files; when the file system says no (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``, ``EACCES``,
``EPERM``) each says so in one line naming the setting and the path - ``output.metrics: cannot
write 'runs/m.jsonl': no space left on the device`` - removes what it had started (a temporary
file, a half-written directory), and leaves what was there before as it was.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from pp_core.errors import PipelineError

__all__ = ["DISK_ERRNOS", "disk_error", "write_failure", "remove_partial", "raise_write_failure"]

DISK_ERRNOS = {errno.ENOSPC: "no space left on the device",
               errno.EDQUOT: "the disk quota is exceeded",
               errno.EFBIG: "the file grew past the size this process may write",
               errno.EROFS: "the file system is read-only",
               errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted"}
"""The errors that say the place cannot take the file, and how a message words them."""

SHORT_ZIP_WRITE = re.compile(r"inline_container\.cc.*unexpected pos \d+ vs \d+")
"""torch's zip writer (``torch.save``, DCP's shards) when the device took fewer bytes than it
wrote: the disk filled mid-file, and no errno reaches Python (seen under DCP on a full disk,
depending on where the last write fell)."""


def disk_error(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` with one of :data:`DISK_ERRNOS` behind ``exc`` (itself, its cause or
    context, or the first failure inside DCP's ``CheckpointException``), else ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            return exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            for failure in failures.values():
                inner = disk_error(failure[0] if isinstance(failure, tuple) else failure)
                if inner is not None:
                    return inner
        found = re.search(r"\(os error (\d+)\)", str(exc))  # safetensors' (Rust) errors
        if found and int(found.group(1)) in DISK_ERRNOS:
            return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
        if isinstance(exc, RuntimeError) and SHORT_ZIP_WRITE.search(str(exc)):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        exc = exc.__cause__ or exc.__context__
    return None


def write_failure(key: str, path: str | os.PathLike, exc: OSError, after: str = "") -> str:
    """``<key>: cannot write '<path>': <reason>[; after]; <the fix>`` for a :func:`disk_error`."""
    reason = DISK_ERRNOS.get(exc.errno, exc.strerror or str(exc))
    fix = "free some space or choose another place" if exc.errno in (
        errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "choose a place this user can write"
    return f"{key}: cannot write {str(path)!r}: {reason}{'; ' + after if after else ''}; {fix}"


def remove_partial(*paths: str | os.PathLike) -> None:
    """Remove files or directories a failed write left (never raises)."""
    for path in paths:
        path = Path(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists() or path.is_symlink():
                path.unlink()
        except OSError:
            pass


def raise_write_failure(key: str, path, exc: BaseException, after: str = "") -> None:
    """Raise :class:`PipelineError` with :func:`write_failure`'s line when ``exc`` is a disk
    error; return otherwise (the caller re-raises)."""
    found = disk_error(exc)
    if found is not None:
        raise PipelineError(write_failure(key, path, found, after)) from None
