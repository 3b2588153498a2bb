"""One writer per output: a run locks its checkpoint directory and its output files.

``pp-core run`` takes, before any rank starts, one lock per place it writes:
``<checkpoint.dir>/.pp-core.lock`` and, beside each ``output.*`` path and the
``checkpoint.export_hf`` directory (an export replaces it whole), ``.<name>.pp-core.lock``. Each is an ``flock`` held by the launching process for the whole run,
and the file says who holds it (pid, host, pipeline file, start time). A second run that wants
any of them is refused before it starts, naming the holder; the kernel releases the ``flock`` of
a process that died however it died, so a lock file a killed run left behind is taken over with
a note naming that run. A finished run removes its lock files.

Who takes the locks: the one launching process on one machine; under ``torchrun`` the process of
rank 0; with ``distributed.nnodes > 1``, the launcher of ``node_rank: 0`` (without a
``node_rank``, no machine knows it is the first, and nothing is locked).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from pp_core.app.output_paths import NOT_PATHS
from pp_core.errors import PPCoreError
from pp_core.write_failures import disk_error, write_failure

__all__ = ["LOCK_NAME", "lock_files", "run_locks", "holders"]

LOCK_NAME = ".pp-core.lock"


def lock_files(spec) -> list[tuple[str, Path]]:
    """``(key, lock file)`` for every place ``spec``'s run writes."""
    found = []
    if spec.checkpoint.dir:
        found.append(("checkpoint.dir", Path(spec.checkpoint.dir).expanduser() / LOCK_NAME))
    beside = [(f"output.{name}", value) for name, value in sorted(vars(spec.output).items())
              if name not in NOT_PATHS]
    if spec.checkpoint.export_hf:
        beside.append(("checkpoint.export_hf", spec.checkpoint.export_hf.get("dir")))
    for key, value in beside:
        if isinstance(value, str) and value and "\0" not in value:
            path = Path(value.rstrip("/" + os.sep) or ".").expanduser()
            found.append((key, path.parent / f".{path.name}{LOCK_NAME}"))
    return found


def _holder_text(text: str) -> str:
    """``pid 123 on host h (pipeline p, started 2026-01-01 10:00:00 UTC)`` from a lock file."""
    try:
        who = json.loads(text)
        return (f"pid {who['pid']} on host {who['host']} (pipeline {who['pipeline']}, started "
                f"{who['started']})")
    except (ValueError, TypeError, KeyError):
        return "a run that left no description"


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16).decode("utf-8", errors="replace").strip()


def _alive_here(text: str) -> bool:
    """Whether the lock file names a live process of this host (when ``flock`` is not there)."""
    try:
        who = json.loads(text)
        if who.get("host") != socket.gethostname():
            return True  # cannot tell: assume it runs
        os.kill(int(who["pid"]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    except PermissionError:
        return True
    return True


def _acquire(key: str, lock: Path, source: str, notes: list[str]) -> int:
    import fcntl  # lazy: POSIX only

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            held = _holder_text(_read(fd))
            os.close(fd)
            raise PPCoreError(
                f"{key}: {str(lock.parent)!r} is being written by another pp-core run: {held}"
                f"; wait for it to end or stop it, or give this run another {key} (lock file "
                f"{str(lock)!r})") from None
        except OSError as exc:  # a file system without flock: the pid decides
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            locked = False
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed it while we opened it: try the new one
            os.close(fd)
            continue
        previous = _read(fd)
        if previous and not locked and _alive_here(previous):
            os.close(fd)
            raise PPCoreError(f"{key}: {str(lock.parent)!r} is being written by another pp-core "
                              f"run: {_holder_text(previous)}; wait for it to end or stop it")
        if previous:
            notes.append(f"{key}: took over the lock {str(lock)!r} of a run that is no longer "
                         f"running ({_holder_text(previous)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "pipeline": source,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        return fd


def _should_lock(spec) -> bool:
    from pp_core.app.rendezvous import started_by_torchrun  # lazy: keeps this module light

    if started_by_torchrun():
        return os.environ.get("RANK") == "0"
    return spec.distributed.max_nodes == 1 or spec.distributed.node_rank == 0


@contextlib.contextmanager
def run_locks(spec, notes: list[str]) -> Iterator[None]:
    """Hold the locks of every place ``spec``'s run writes (see the module docstring); refuse
    with one :class:`PPCoreError` naming the holder when another live run holds one."""
    held: list[tuple[int, Path]] = []
    try:
        if _should_lock(spec):
            for key, lock in lock_files(spec):
                try:
                    lock.parent.mkdir(parents=True, exist_ok=True)
                    held.append((_acquire(key, lock, str(spec.source), notes), lock))
                except OSError as exc:
                    cause = disk_error(exc)
                    if cause is None:
                        raise
                    raise PPCoreError(write_failure(key, lock, cause)) from None
        yield
    finally:
        for fd, lock in reversed(held):
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(fd)


def holders(spec) -> list[str]:
    """A line per place ``spec`` writes that a live run holds now (for ``validate``; nothing is
    created or written)."""
    import fcntl  # lazy: POSIX only

    found = []
    for key, lock in lock_files(spec):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            found.append(f"{key}: {str(lock.parent)!r} is being written by another pp-core run "
                         f"now ({_holder_text(_read(fd))}); a run would be refused until it ends")
        except OSError:
            pass
        finally:
            os.close(fd)
    return found
