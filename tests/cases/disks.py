"""A real small disk for tests: a tmpfs of a given size mounted in the test (root, and a machine
that allows it), unmounted afterwards; or ``pytest.skip`` where it cannot be mounted (the
``RLIMIT_FSIZE`` tests cover those machines)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: int, read_only: bool = False):
    """``path`` as a tmpfs of ``size`` bytes (``read_only``: mounted so, after the test's files
    are in; call ``remount(path, read_only=True)`` for that)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:100]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, read_only: bool) -> None:
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(path)],
                   check=True, capture_output=True)


def fill(path: Path, leave: int = 0) -> None:
    """Fill the disk holding ``path`` until ``leave`` bytes (about) are free."""
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(path / ".filler", "wb") as handle:
        try:
            handle.write(b"\0" * max(0, free - leave))
        except OSError:
            pass
