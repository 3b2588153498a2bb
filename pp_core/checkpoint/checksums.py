"""A checksum of every file of a checkpoint, recorded while it is written and checked when it is read.

Saving: each rank writes its DCP files through :func:`hashing_writer`, a ``FileSystemWriter``
whose streams hash the bytes on their way to the file (one pass, no second read); rank 0 gathers
every rank's digests and writes them, with those of the files it adds itself (the record), to
the checksums file (:mod:`pp_core.checkpoint.record` names it) before the checkpoint is renamed
into place::

    {"algorithm": "sha256", "files": {"__0_0.distcp": {"size": 1234, "sha256": "..."}, ...}}

Reading (:func:`verify_checkpoint`: resume, load, export): every file listed must be there with
its size and digest; the first that differs is refused in one line naming it and the directory
(4 KiB zeroed inside a shard, same size, included). ``checkpoint.verify: false`` (``pp-core
export --no-verify``) skips the check. A checkpoint without the file is read as before when it
comes from an older pp-core, and refused when its record says it was written
(:func:`~pp_core.checkpoint.record.promises_checksums`), and so is a list that leaves out a file
the DCP metadata references (:func:`check_listed`). A path verified once is not read again
by the same command (its ranks inherit the record through ``$PP_CORE_VERIFIED_CHECKPOINTS``),
unless its list changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from pp_core.checkpoint.record import CHECKSUMS_FILE, corrupt, promises_checksums
from pp_core.errors import PipelineError

__all__ = ["ALGORITHM", "hashing_writer", "files_missed", "manifest_text", "verify_checkpoint",
           "check_listed"]

ALGORITHM = "sha256"
BLOCK = 1 << 23  # bytes read at a time when verifying
_VERIFIED_ENV = "PP_CORE_VERIFIED_CHECKPOINTS"


class _HashingStream:
    """A binary file whose writes are hashed on the way (DCP only writes, tells and fsyncs)."""

    def __init__(self, raw):
        self.raw = raw
        self.digest = hashlib.new(ALGORITHM)
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        return self.raw.write(view)

    def __getattr__(self, name):  # tell, flush, fileno, close, seekable, ...
        return getattr(self.raw, name)


def hashing_writer(path: str | os.PathLike):
    """A DCP ``FileSystemWriter`` for ``path`` (the defaults of ``dcp.save(checkpoint_id=...)``)
    whose ``digests`` maps each file it wrote to ``{"size", "sha256"}``."""
    from torch.distributed.checkpoint import FileSystemWriter  # lazy: DCP, seconds
    from torch.distributed.checkpoint.filesystem import FileSystem

    digests: dict[str, dict] = {}

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw)
                yield stream
            digests[Path(path).name] = {"size": stream.size,
                                        ALGORITHM: stream.digest.hexdigest()}

        def rename(self, path, new_path):  # .metadata.tmp -> .metadata
            super().rename(path, new_path)
            if Path(path).name in digests:
                digests[Path(new_path).name] = digests.pop(Path(path).name)

    writer = FileSystemWriter(path)
    writer.fs = HashingFileSystem()
    writer.digests = digests
    return writer


def files_missed(directory: Path, digests: dict[str, dict]) -> dict[str, dict]:
    """Digests of the files in ``directory`` the writers did not hash (a torch release that
    opens a file past ``create_stream``): read once, so the list still covers every file."""
    return {file.name: {"size": file.stat().st_size, ALGORITHM: _digest_of(file)}
            for file in sorted(Path(directory).iterdir())
            if file.is_file() and file.name not in digests}


def manifest_text(digests: dict[str, dict], extra_files: dict[str, str] | None = None) -> str:
    """The text of the checksums file: ``digests`` and those of ``extra_files``."""
    files = dict(digests)
    for name, text in (extra_files or {}).items():
        data = text.encode("utf-8")
        files[name] = {"size": len(data), ALGORITHM: hashlib.new(ALGORITHM, data).hexdigest()}
    return json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))},
                      indent=1) + "\n"


def _digest_of(file: Path) -> str:
    digest = hashlib.new(ALGORITHM)
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _corrupt(path: Path, why: str) -> PipelineError:
    return corrupt(path, why, checked=True)


def _manifest(path: Path) -> dict | None:
    file = path / CHECKSUMS_FILE
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        files = manifest["files"]
        ok = manifest.get("algorithm") == ALGORITHM and isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int)
            and isinstance(v.get(ALGORITHM), str) for v in files.values())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _corrupt(path, f"its {CHECKSUMS_FILE} cannot be read ({type(exc).__name__})") \
            from None
    if not ok:
        raise _corrupt(path, f"its {CHECKSUMS_FILE} is not a list of {ALGORITHM} checksums")
    return manifest


def _stamp(path: Path, names) -> str:
    """The checkpoint as last verified: its list and every file's size and modification time."""
    digest = hashlib.sha256((path / CHECKSUMS_FILE).read_bytes())
    for name in names:
        with contextlib.suppress(OSError):
            info = (path / name).stat()
            digest.update(f"{name}:{info.st_size}:{info.st_mtime_ns}".encode())
    return f"{os.path.realpath(path)}={digest.hexdigest()[:24]}"


def verify_checkpoint(path: str | os.PathLike, verify: bool = True) -> None:
    """Check every file of the checkpoint at ``path`` against its recorded size and checksum
    (nothing with ``verify=False``); one :class:`PipelineError` naming the first that differs."""
    path = Path(path)
    if not verify:
        return
    manifest = _manifest(path)
    if manifest is None:
        if (promise := promises_checksums(path)) is not None:
            raise _corrupt(path, f"its {CHECKSUMS_FILE} is missing (its {promise} says one was "
                                 f"written)")
        return  # an older pp-core's checkpoint: nothing recorded to check against
    stamp = _stamp(path, sorted(manifest["files"]))
    if stamp in os.environ.get(_VERIFIED_ENV, "").split(os.pathsep):
        verify = False  # this command checked it already; sizes only
    for name, recorded in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            raise _corrupt(path, f"its file {name} is missing")
        size = file.stat().st_size
        if size != recorded["size"]:
            raise _corrupt(path, f"its file {name} holds {size} bytes, {recorded['size']} were "
                                 f"written")
        if verify and _digest_of(file) != recorded[ALGORITHM]:
            raise _corrupt(path, f"its file {name} does not match the {ALGORITHM} checksum "
                                 f"recorded when it was written (its bytes changed since)")
    if verify:
        known = [s for s in os.environ.get(_VERIFIED_ENV, "").split(os.pathsep) if s]
        os.environ[_VERIFIED_ENV] = os.pathsep.join(known[-7:] + [stamp])


def check_listed(path: str | os.PathLike, referenced, verify: bool = True) -> None:
    """Refuse a checkpoint whose checksums list leaves out a file its DCP ``.metadata``
    references (``referenced``: their names) or the ``.metadata`` itself: a file dropped from
    the list would otherwise be read unverified (nothing with ``verify=False``)."""
    path = Path(path)
    manifest = _manifest(path) if verify else None
    if manifest is None:
        return  # no list: verify_checkpoint already refused one that was promised
    unlisted = sorted((set(referenced) | {".metadata"}) - set(manifest["files"]))
    if unlisted:
        raise _corrupt(path, f"its file {unlisted[0]} is not in its {CHECKSUMS_FILE} (every "
                             f"file the checkpoint's .metadata names must be listed and "
                             f"verified)")
