"""Every path a command reads and writes, and the pairs that would overwrite one another.

A run reads its pipeline file, a schedule CSV, data and tokenizer files named in ``*.args``
the token cache (``*cache_dir``) and the checkpoint it resumes from; it writes ``output.*`` files,
checkpoints under ``checkpoint.dir`` (``step_NNNNNNNN`` directories and the ``latest`` pointer,
which it replaces) and the ``checkpoint.export_hf`` directory (replaced as a whole). ``export -o``
is checked against the checkpoint and what the run it records read (:func:`recorded_reads`),
``schedule export FILE.yaml -o`` against what that file's run reads (:func:`pipeline_reads`).
:func:`collisions` compares all of them at once, by the file they resolve to (symbolic links,
``..`` and hard links included), so a write that lands on an input, on another output or inside
what the checkpoint directory manages is refused naming both keys: one check for every key,
present and future (any string under ``output`` is a path written). :func:`path_problems` refuses
what is not a path at all (a NUL byte) or names a directory where a file is written;
:func:`writable_problem` what cannot be created there (a directory where a file goes, a path under
a regular file, a virtual file system such as ``/proc``, no permission, a full disk).

Used by ``validate`` and ``run`` (:func:`pp_core.app.check.outputs.check_outputs`), by ``plan -o``
and ``export -o`` before any work, and by the schedule commands (``--csv X -o X``). No torch
here: the schedule commands import it.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pp_core.app.spec.paths import NOT_PATHS
from pp_core.errors import PPCoreError, quoted

__all__ = ["PathUse", "run_paths", "recorded_reads", "pipeline_reads", "collisions", "path_problems", "writable_problem",
           "refuse_collisions", "refuse_output", "refuse_export_collisions"]

CHECKPOINT_MANAGED = ("step_*", "latest", ".latest.tmp-*")
"""Entries of ``checkpoint.dir`` a save creates, moves aside or replaces."""



@dataclass(frozen=True)
class PathUse:
    """One path a command touches: ``key`` names it as the user wrote it (``output.metrics``,
    ``the pipeline file``); ``tree``: a directory whose contents belong to it (a checkpoint);
    ``managed``: for a tree, the entry patterns a save replaces or a read takes (others are left
    alone); ``pattern``: ``path`` is a glob (read), and whatever it matches, or lies inside a
    match, is read."""

    key: str
    path: str
    writes: bool
    tree: bool = False
    managed: tuple[str, ...] = ()
    pattern: bool = False


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _same(a: str, b: str) -> bool:
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links, case-insensitive file systems
    except (OSError, ValueError):
        return False


def _inside(path: str, tree: str) -> str | None:
    """The first component of ``path`` below ``tree`` when it lies inside, else ``None``."""
    rel = os.path.relpath(_real(path), _real(tree))
    if rel == "." or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return rel.split(os.sep)[0]


def _parts(path: str) -> list[str]:
    return [p for p in os.path.normpath(os.path.abspath(os.path.expanduser(path))).split(os.sep)
            if p]


def _glob_match(pattern: list[str], path: list[str]) -> bool:
    """Whether ``path`` (components) matches the glob ``pattern`` (components; ``**`` spans any
    number of them, as ``glob(recursive=True)`` reads it)."""
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_glob_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and \
        _glob_match(pattern[1:], path[1:])


def _glob_covers(pattern: str, path: str) -> bool:
    """Whether the glob ``pattern`` matches ``path`` or a directory holding it (a matched
    directory is read whole)."""
    wanted = _parts(pattern)
    for target in {tuple(_parts(path)), tuple(_parts(_real(path)))}:
        if any(_glob_match(wanted, list(target[:end])) for end in range(1, len(target) + 1)):
            return True
    return False


def _clash(a: PathUse, b: PathUse) -> str | None:
    """Why ``a`` and ``b`` cannot both be used as given (``a`` writes), or ``None``."""
    if b.pattern and not b.writes:
        if _glob_covers(b.path, a.path):
            return (f"{a.key} {a.path!r} matches {b.key} {b.path!r}, which this command reads: "
                    f"the next run would read it as input; write {a.key} somewhere the pattern "
                    f"does not reach")
        return None
    if _same(a.path, b.path):
        if b.writes:
            return (f"{a.key} and {b.key} name the same path {a.path!r}: one would overwrite "
                    f"the other; give them different paths")
        return (f"{a.key} {a.path!r} is {b.key}, which this command reads: it would be "
                f"overwritten; write {a.key} somewhere else")
    for outer, inner in ((a, b), (b, a)):
        if not outer.tree or {outer.key, inner.key} == {"checkpoint.dir", "checkpoint.resume"}:
            continue  # resuming from a checkpoint of checkpoint.dir is what it is for
        entry = _inside(inner.path, outer.path)
        if entry is None:
            continue
        if outer.managed and not any(fnmatch.fnmatchcase(entry, p) for p in outer.managed):
            continue  # a place in the checkpoint directory that saves (and reads) leave alone
        if outer.writes and outer.managed:
            return (f"{inner.key} {inner.path!r} lies at {entry!r} inside {outer.key} "
                    f"{outer.path!r}, which a checkpoint save replaces or moves aside; put "
                    f"{inner.key} outside it (or elsewhere than {', '.join(outer.managed)})")
        if outer.writes:
            return (f"{inner.key} {inner.path!r} lies at {entry!r} inside {outer.key} "
                    f"{outer.path!r}, which is replaced as a whole directory when it is "
                    f"written; put {outer.key} somewhere that holds neither")
        if inner.writes:
            return (f"{inner.key} {inner.path!r} lies at {entry!r} inside {outer.key} "
                    f"{outer.path!r}, which this command reads: writing there changes its "
                    f"input; choose another place")
    return None


def collisions(uses: Iterable[PathUse]) -> list[str]:
    """One line per pair of paths that overwrite or change one another (a write involved)."""
    uses = [u for u in uses if u.path and "\0" not in u.path and not (u.pattern and u.writes)]
    found = []
    for i, a in enumerate(uses):
        for b in uses[i + 1:]:
            if not (a.writes or b.writes):
                continue
            first, second = (a, b) if a.writes else (b, a)
            why = _clash(first, second)
            if why is not None:
                found.append(why)
    return found


OUTPUT_DIRECTORIES = ("tensorboard",)
"""``output`` keys that name a directory (TensorBoard writes its event files into one)."""


def path_problems(uses: Iterable[PathUse]) -> list[str]:
    """A NUL byte in any path; a written file named as a directory (a trailing separator)."""
    found = []
    for use in uses:
        if "\0" in use.path:
            found.append(f"{use.key}: {use.path!r} holds a NUL byte, which no file name can "
                         f"hold; remove it")
        elif use.writes and not use.tree and use.path.endswith(("/", os.sep)):
            name = Path(use.key.rsplit(".", 1)[-1]).name or "output"
            found.append(f"{use.key}: {use.path!r} names a directory (it ends with "
                         f"{use.path[-1]!r}), expected a file; e.g. "
                         f"{use.path.rstrip('/' + os.sep) or '.'}/{name}{_suffix(use.key)}")
    return found


def _suffix(key: str) -> str:
    return {"output.metrics": ".jsonl", "output.trace": ".json",
            "output.schedule_image": ".svg"}.get(key, "")


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def run_paths(spec) -> list[PathUse]:
    """Every path a ``pp-core run`` of ``spec`` reads or writes."""
    uses = [PathUse("the pipeline file", spec.source, False)] if \
        Path(spec.source).is_file() else []
    csv = spec.pipeline.pp_schedule_csv
    if isinstance(csv, str):
        uses.append(PathUse("pipeline.pp_schedule_csv", csv, False))
    for section, sub in (("data", "args"), ("data", "eval_args"), ("model", "args")):
        for name, value in (getattr(getattr(spec, section), sub)).items():
            uses += _argument_reads(f"{section}.{sub}.{name}", value)
    resume = spec.checkpoint.resume
    if isinstance(resume, str):
        uses.append(PathUse("checkpoint.resume", resume, False, tree=True))
    if spec.checkpoint.dir:
        uses.append(PathUse("checkpoint.dir", spec.checkpoint.dir, True, tree=True,
                            managed=CHECKPOINT_MANAGED))
    for name, value in vars(spec.output).items():
        if name not in NOT_PATHS and isinstance(value, str) and value:
            uses.append(PathUse(f"output.{name}", value, True, tree=name in OUTPUT_DIRECTORIES))
    export = spec.checkpoint.export_hf
    if export and isinstance(export.get("dir"), str):
        uses.append(PathUse("checkpoint.export_hf", export["dir"], True, tree=True))
    return uses


def recorded_reads(sections: dict) -> list[PathUse]:
    """What the run a checkpoint records read (``{"model": {"args": ...}, "data": {...}}``):
    the base model, tokenizer, processor and corpus an export of it must not overwrite."""
    uses = []
    for section, sub in (("model", "args"), ("data", "args")):
        args = (sections.get(section) or {}).get(sub) or {}
        for name, value in (args.items() if isinstance(args, dict) else ()):
            uses += _argument_reads(f"the run's {section}.{sub}.{name}", value)
    return uses


def _argument_reads(key: str, value: Any) -> list[PathUse]:
    """What an argument reads: an existing file; an existing directory (all it holds: a corpus, a
    tokenizer); a glob (whatever it matches). A ``*cache_dir`` argument (the token cache) is
    read whole, whether it exists yet or not: no output may land inside it."""
    if key.endswith("cache_dir"):
        return [PathUse(key, value, False, tree=True)] if isinstance(value, str) and value \
            and "\0" not in value else []
    uses = []
    for text in _strings(value):
        if "\0" in text or not text:
            continue
        path = os.path.expanduser(text)
        if os.path.isfile(path):
            uses.append(PathUse(key, text, False))
        elif os.path.isdir(path):
            uses.append(PathUse(key, text, False, tree=True))
        elif glob.has_magic(path):
            uses.append(PathUse(key, text, False, pattern=True))
    return uses


def pipeline_reads(source: str) -> list[PathUse]:
    """What the run of the pipeline file ``source`` reads, from its YAML alone (no torch, no
    plugin: the schedule commands use it): the file, its schedule CSV, every existing path or
    glob under ``model.args`` / ``data.args`` (relative ones against the file's folder)."""
    from pp_core.app.spec.paths import absolute  # lazy: with a pipeline file
    from pp_core.app.spec.yaml import read_yaml

    try:
        data = read_yaml(Path(source).read_bytes()) or {}
    except Exception:  # noqa: BLE001 - the command reports an unreadable file itself
        return []
    folder = os.path.dirname(os.path.abspath(source))
    sections = {name: data.get(name) if isinstance(data, dict) else None
                for name in ("model", "data", "pipeline")}
    resolved = {name: {"args": {k: absolute(v, folder)
                                for k, v in ((section or {}).get("args") or {}).items()}
                       if isinstance((section or {}).get("args"), dict) else {}}
                for name, section in sections.items() if isinstance(section, dict)}
    uses = [PathUse("the pipeline file", source, False)]
    csv = (sections.get("pipeline") or {}).get("pp_schedule_csv")
    if isinstance(csv, str) and csv:
        uses.append(PathUse("pipeline.pp_schedule_csv", absolute(csv, folder), False))
    return uses + [PathUse(u.key.replace("the run's ", ""), u.path, u.writes, u.tree, u.managed,
                           u.pattern) for u in recorded_reads(resolved)]


def refuse_collisions(reads: dict[str, str | None], writes: dict[str, str | None],
                      uses: Iterable[PathUse] = ()) -> None:
    """Raise :class:`~pp_core.errors.PPCoreError` when a command's outputs would overwrite its
    inputs or each other (``{flag: path}``; ``None`` and ``-`` for stdout are skipped;
    ``uses``: more paths it reads, e.g. :func:`pipeline_reads`)."""
    uses = [PathUse(k, p, False) for k, p in reads.items() if p and p != "-"] + list(uses)
    uses += [PathUse(k, p, True) for k, p in writes.items() if p and p != "-"]
    problems = path_problems(uses) + collisions(uses)
    if problems:
        raise PPCoreError("; ".join(problems))


def refuse_export_collisions(argument: str, source: str, output: str,
                             kind: str | None = None, run: dict | None = None) -> None:
    """``pp-core export CKPT -o OUT``: refuse an ``-o`` that lands on or inside the checkpoint it
    reads (``source``, the step directory), or on what a checkpoint.dir given as ``argument``
    points through (``latest``, its ``step_*`` directories), or - once the checkpoint's record
    is read, ``run`` - on what the run it was saved by read (its base model, tokenizer,
    processor, corpus), or that cannot be created as ``kind`` (a directory export replaces
    ``OUT`` whole: refused where ``OUT`` holds what no export writes)."""
    uses = [PathUse("CKPT", source, False, tree=True)]
    if not _same(argument, source):
        uses.append(PathUse("CKPT", argument, False, tree=True, managed=CHECKPOINT_MANAGED))
    refuse_output("-o", output, uses + recorded_reads(run or {}), kind=kind)


def writable_problem(key: str, path: str, kind: str | None = "file") -> str | None:
    """Why ``path`` cannot be written as ``kind`` (``"file"``, ``"directory"``, or ``None``:
    either), nothing being created; ``None`` when it can."""
    target = Path(os.path.expanduser(path))
    if target.exists():
        found = "a directory" if target.is_dir() else "a file"
        if kind is not None and found != f"a {kind}":
            return f"{key}: {quoted(path)} is {found}, expected a {kind}; choose another path"
        if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            return (f"{key}: {quoted(path)} is not writable by this user; fix its permissions "
                    f"or choose another path")
        return _space_problem(key, target if target.is_dir() else target.parent, path)
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return (f"{key}: cannot create {quoted(path)}: {quoted(str(ancestor))} is a file, not a "
                f"directory; choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return (f"{key}: cannot create {quoted(path)}: no permission to write in "
                f"{quoted(str(ancestor))}; choose a writable place")
    return _space_problem(key, ancestor, path)


def _space_problem(key: str, directory: Path, path: str) -> str | None:
    usage = shutil.disk_usage(directory)
    where = quoted(str(directory))
    if usage.total == 0:  # /proc, /sys: nothing written there is kept as a file
        return (f"{key}: cannot create {quoted(path)}: {where} holds no files (a virtual file "
                f"system); choose another place")
    if usage.free == 0:
        return (f"{key}: no space left on the device holding {where}; free some space or "
                f"choose another place")
    return None


def refuse_output(key: str, path: str, uses: Iterable[PathUse], kind: str | None = "file") -> None:
    """A command's own output (``-o``) before it does any work: not one of the paths it or the
    run it describes uses (``uses``; landing on or inside an input, or on an output), and
    writable as ``kind`` (:func:`writable_problem`); raises :class:`PPCoreError`."""
    output = PathUse(key, path, True, tree=kind == "directory")
    problems = path_problems([output]) + [
        why for use in uses if use.path and "\0" not in use.path
        and (why := _clash(output, use)) is not None]
    problem = problems[0] if problems else writable_problem(key, path, kind)
    if problem is None and kind == "directory":
        from pp_core.app.export.staging import replace_problem  # lazy: only a directory export

        problem = replace_problem(key, path)
    if problem is not None:
        raise PPCoreError(problem)
