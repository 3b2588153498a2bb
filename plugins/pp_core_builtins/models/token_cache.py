"""The on-disk cache of a corpus's token ids: built once, checked against its own checksums.

``<cache_dir>/<key>/`` holds ``tokens.bin`` (uint32 token ids of every document back to back,
read through ``numpy.memmap``), ``offsets.npy`` (document ``d`` is
``tokens[offsets[d]:offsets[d + 1]]``) and ``meta.json``. The key hashes the files' contents, how
they are read and the tokenizer (its file contents, BOS/EOS), so changing any of them tokenizes
again and an unchanged corpus opens at once. Ranks that start together take a file lock: one
tokenizes, the others wait and open its result; the directory appears by an atomic rename, so a
killed run never leaves half a cache, and a failed build (a full disk: one line naming
``data.args.cache_dir``) removes its staging directory.

``meta.json`` records each file's size and sha256, hashed while it was written. The first open
in a process checks the sizes and the sha256 of both files - their content, not their stamp: an
overwrite in place that keeps the inode, the size and the modification time changes the tokens
all the same. Later opens in the process re-hash a file only when its status changed since
(``ctime`` included, which no ``utime`` can set back). An overwritten ``tokens.bin``, a replaced
``offsets.npy`` or a truncated file is found: the cache is tokenized again (or, where it cannot be
replaced, the message names the directory to delete). The hash costs about what hashing the
corpus for the cache key costs, times the cache's size over the corpus's (1x to 4x; 0.9 s per
64 MiB of text with the byte tokenizer: docs/benchmarks.md, "The token cache's digest").
``pp-core validate`` (``$PP_CORE_VALIDATING``) writes nothing there: a missing or damaged cache
is built in a temporary directory for the check and removed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from pp_core import PipelineError
from pp_core_builtins.models.corpus import expand_files, read_documents

__all__ = ["TokenCache", "open_cache", "CACHE_VERSION", "VALIDATING_ENV"]

CACHE_VERSION = 2  # 2: meta.json records each file's sha256
VALIDATING_ENV = "PP_CORE_VALIDATING"
"""Set while ``pp-core validate`` builds the dataset: the cache directory is only read."""
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}

logger = logging.getLogger(__name__)


class TokenCache:
    """A tokenized corpus on disk: ``tokens`` (a uint32 memmap) and document ``offsets``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        self.offsets = np.load(directory / "offsets.npy")
        count = int(self.offsets[-1])
        self.tokens = np.memmap(directory / "tokens.bin", dtype=np.uint32, mode="r",
                                shape=(max(count, 1),))
        self.num_docs = len(self.offsets) - 1

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]


def _cache_key(files: list[Path], reading: dict, tokenizer, bos: Optional[int],
               eos: Optional[int]) -> str:
    digest = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "reading": reading,
                                        "tokenizer": tokenizer.identity, "bos": bos,
                                        "eos": eos}, sort_keys=True).encode())
    for file in files:
        targets = sorted(p for p in file.rglob("*") if p.is_file()) if file.is_dir() else [file]
        for target in targets:
            digest.update(target.name.encode() + b"\0")
            with open(target, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()[:24]


def _progress(total: int, label: str):
    try:
        from tqdm import tqdm  # lazy: tqdm is an optional extra
    except ImportError:  # no bar, the result is the same
        return None
    return tqdm(total=total, desc=label, unit="doc", file=sys.stderr, disable=None,
                leave=False)


class _Hashed:
    """A binary file whose bytes are hashed as they are written (the cache's checksums)."""

    def __init__(self, path: Path):
        self.path, self.handle, self.digest = path, open(path, "wb"), hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.digest.update(data)
        self.handle.write(data)

    def close(self) -> dict:
        self.handle.close()
        return {"sha256": self.digest.hexdigest(), "size": self.path.stat().st_size}


_VERIFIED: dict[str, tuple] = {}
"""Per cache file this process hashed and found whole: its full status then (``ctime`` too)."""


def _status(path: Path) -> tuple:
    info = path.stat()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _build(directory: Path, files: list[Path], reading: dict, tokenizer, bos, eos) -> None:
    """Tokenize into a staging directory beside ``directory`` and rename it in; on any failure
    the staging directory is removed (a full disk is one line naming data.args.cache_dir)."""
    texts = [text for file in files for text in
             read_documents(file, reading["text_field"], reading["doc_separator"],
                            reading["hf_split"])]
    if not texts:
        raise ValueError(f"tokenized_text: the corpus ({', '.join(map(str, files))}) holds no "
                         f"text; check data.args.files and data.args.text_field")
    staging = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        _write(staging, files, texts, reading, tokenizer, bos, eos)
        os.replace(staging, directory)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            raise PipelineError(
                f"data.args.cache_dir: cannot write the token cache {str(staging)!r}: "
                f"{os.strerror(exc.errno).lower()}; nothing was left behind; free some space "
                f"or set data.args.cache_dir to a place with room") from None
        raise


def _write(staging: Path, files, texts, reading, tokenizer, bos, eos) -> None:
    offsets, count, max_id = [0], 0, -1
    bar = _progress(len(texts), f"tokenizing {len(texts)} documents")
    out = _Hashed(staging / "tokens.bin")
    try:
        for start in range(0, len(texts), 1024):
            for ids in tokenizer.encode_batch(texts[start:start + 1024]):
                ids = ([bos] if bos is not None else []) + list(ids) + \
                    ([eos] if eos is not None else [])
                array = np.asarray(ids, dtype=np.uint32)
                out.write(array.tobytes())
                count += len(array)
                offsets.append(count)
                if len(array):
                    max_id = max(max_id, int(array.max()))
            if bar is not None:
                bar.update(min(1024, len(texts) - start))
    finally:
        checksums = {"tokens.bin": out.close()}
        if bar is not None:
            bar.close()
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(offsets, dtype=np.int64))
    index = _Hashed(staging / "offsets.npy")
    index.write(buffer.getvalue())
    checksums["offsets.npy"] = index.close()
    (staging / "meta.json").write_text(json.dumps({
        "files": [str(f) for f in files], "num_docs": len(texts), "num_tokens": count,
        "max_token_id": max_id, "vocab_size": tokenizer.vocab_size, "bos": bos, "eos": eos,
        **reading, "checksums": checksums}, indent=1))


def _damage(directory: Path) -> str | None:
    """What is wrong with the cache at ``directory`` (a file changed since it was written: its
    size, or - when it was touched at all - its sha256), or ``None``."""
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        recorded = meta["checksums"]
        for name in ("tokens.bin", "offsets.npy"):
            want, path = recorded[name], directory / name
            status = _status(path)
            if status[2] != want["size"]:
                return f"{name} holds {status[2]} bytes, {want['size']} were written"
            if _VERIFIED.get(str(path)) == status:  # hashed by this process, untouched since
                continue
            if _digest(path) != want["sha256"]:
                return f"{name} does not match the sha256 checksum recorded when it was written"
            _VERIFIED[str(path)] = status
    except FileNotFoundError as exc:
        return f"{Path(exc.filename or '?').name} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"meta.json cannot be read ({type(exc).__name__})"
    return None


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def _cannot_replace(directory: Path, damage, exc: OSError):
    raise PipelineError(
        f"data.args.cache_dir: the token cache {str(directory)!r} is damaged ({damage}) and "
        f"cannot be replaced here ({exc.strerror}); delete {str(directory)!r} and run "
        f"again") from None


def _discard(directory: Path, damage: str) -> None:
    """Move a damaged cache out of the way (then remove it), or say which directory to delete."""
    aside = directory.with_name(f"{directory.name}.bad{os.getpid()}")
    try:
        os.rename(directory, aside)
    except OSError as exc:
        _cannot_replace(directory, damage, exc)
    logger.warning("tokenized_text: the token cache %r is damaged (%s): tokenizing again",
                   str(directory), damage)
    shutil.rmtree(aside, ignore_errors=True)


def open_cache(files, tokenizer, cache_dir, reading: dict, bos, eos) -> TokenCache:
    """The cache of ``files`` tokenized by ``tokenizer``: opened after checking its files against
    their recorded checksums, or built once (locked; a damaged one is rebuilt). While
    ``$PP_CORE_VALIDATING`` is set (``pp-core validate``) nothing is written to ``cache_dir``: a
    missing or damaged cache is built in a temporary directory, opened, and removed."""
    root = Path(os.path.expanduser(str(cache_dir)))
    if root.exists() and not root.is_dir():
        raise ValueError(f"tokenized_text: cache_dir={str(cache_dir)!r} is a file, expected a "
                         f"directory for the token cache (it is created when missing)")
    paths = expand_files(files)
    key = _cache_key(paths, reading, tokenizer, bos, eos)
    directory = root / key
    if directory.is_dir() and _damage(directory) is None:
        return TokenCache(directory)
    if os.environ.get(VALIDATING_ENV):
        with tempfile.TemporaryDirectory(prefix="pp-core-validate-cache-") as scratch:
            _build(Path(scratch) / key, paths, reading, tokenizer, bos, eos)
            return TokenCache(Path(scratch) / key)  # mapped: readable once removed (POSIX)
    import fcntl  # lazy: POSIX only, and only when a cache is built

    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "a")
    except OSError as exc:
        if directory.is_dir():  # damaged, and nothing can be written here
            _cannot_replace(directory, _damage(directory), exc)
        raise PipelineError(f"data.args.cache_dir: cannot write the token cache in "
                            f"{str(root)!r}: {exc.strerror}; set data.args.cache_dir to a "
                            f"writable place") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        damage = _damage(directory) if directory.is_dir() else None
        if damage is not None:  # not rebuilt by another rank meanwhile
            _discard(directory, damage)
        if not directory.is_dir():
            _build(directory, paths, reading, tokenizer, bos, eos)
    return TokenCache(directory)
