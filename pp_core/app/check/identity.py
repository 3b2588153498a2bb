"""What a path in ``model.args`` resolves to, as a digest: the resume check compares content.

A checkpoint's ``run`` section records, beside ``model.args`` as written, ``resolved``: for each
argument naming a file or directory on disk (``model.args.config``, ``model.args.checkpoint``),
a digest of what it held when the checkpoint was saved. The resume check compares those digests,
not the path strings: ``base`` and the same directory's absolute path are one model; a path that
now names another model (another working directory, a directory edited or replaced since) is
another, whatever its shapes.

The digest of a directory covers its ``config.json``, index and weight files; of a file, the
file. Files up to :data:`WHOLE` bytes are hashed whole; a larger weight file by its size, its
first :data:`WHOLE` bytes (a safetensors file's header: every name, shape, dtype and offset) and
three blocks spread through it - cheap at every save, and two trained models of the same shapes
differ there.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["fingerprint", "resolved_paths"]

WHOLE = 1 << 22
MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _file_digest(file: Path, digest) -> None:
    size = file.stat().st_size
    digest.update(f"{file.name}:{size}:".encode())
    with open(file, "rb") as handle:
        if size <= WHOLE:
            digest.update(handle.read())
            return
        digest.update(handle.read(WHOLE))
        for fraction in (1, 2, 3):
            handle.seek(size * fraction // 4)
            digest.update(handle.read(1 << 16))


def fingerprint(path: str) -> str | None:
    """The digest of what ``path`` holds (module docstring), or ``None`` when it is not there."""
    target = Path(path)
    digest = hashlib.sha256()
    try:
        if target.is_file():
            _file_digest(target, digest)
        elif target.is_dir():
            files = sorted(p for p in target.iterdir() if p.is_file() and (
                p.name == "config.json" or p.name.endswith(".index.json")
                or p.suffix in MODEL_SUFFIXES))
            for file in files:
                _file_digest(file, digest)
        else:
            return None
    except OSError:
        return None
    return digest.hexdigest()[:32]


def resolved_paths(args: dict) -> dict[str, str]:
    """``{argument: digest}`` for each argument of ``args`` naming an absolute path on disk."""
    found = {}
    for name, value in (args or {}).items():
        if isinstance(value, str) and os.path.isabs(os.path.expanduser(value)):
            digest = fingerprint(os.path.expanduser(value))
            if digest is not None:
                found[name] = digest
    return found
