"""Every path a run writes, checked before any process starts: writable, with room, of the right
kind (a file or a directory), and overwriting no input or other output
(:mod:`pp_core.app.output_paths`); nothing is created. An existing output gets a note: a
checkpoint directory that already holds checkpoints, a metrics file appended to or replaced.
"""

from __future__ import annotations

from pathlib import Path

from pp_core.app.output_paths import collisions, path_problems, run_paths, writable_problem
from pp_core.app.spec import Spec
from pp_core.errors import quoted

__all__ = ["check_outputs"]


def check_outputs(spec: Spec, problems: list[str], notes: list[str]) -> None:
    """Every output path can be written (nothing is created) and overwrites no input or other
    output (:mod:`pp_core.app.output_paths`); an existing file gets a note."""
    uses = run_paths(spec)
    clashes = path_problems(uses) or collisions(uses)
    if clashes:
        problems.extend(clashes)
        return
    resume = bool(spec.checkpoint.resume)
    directory = spec.checkpoint.dir
    if directory is not None and _check_path("checkpoint.dir", Path(directory), True, problems) \
            and not resume and any(Path(directory).glob("step_*")):
        from pp_core.checkpoint import latest_checkpoint  # lazy: DCP, seconds

        latest = latest_checkpoint(directory)
        if latest is not None:
            notes.append(f"checkpoint.dir: {quoted(directory)} holds checkpoints up to "
                         f"{latest.name}; this run starts at step 0 and replaces those it "
                         f"saves again (checkpoint.resume: true continues from {latest.name})")
    for name in ("metrics", "trace", "schedule_image"):
        path = getattr(spec.output, name)
        if path is None:
            continue
        key = f"output.{name}"
        if _check_path(key, Path(path), False, problems) and Path(path).is_file():
            kept = "appended to (checkpoint.resume is set)" if name == "metrics" and resume \
                else "replaced"
            notes.append(f"{key}: {quoted(path)} exists and will be {kept}")
    if spec.output.tensorboard:  # a directory TensorBoard writes its event files into
        _check_path("output.tensorboard", Path(spec.output.tensorboard), True, problems)
    export = spec.checkpoint.export_hf
    if export and _check_path("checkpoint.export_hf", Path(export["dir"]), True, problems):
        from pp_core.app.export.staging import replace_problem  # lazy: with export_hf

        if (problem := replace_problem("checkpoint.export_hf", export["dir"])) is not None:
            problems.append(problem)


def _check_path(key: str, path: Path, is_dir: bool, problems: list[str]) -> bool:
    """Whether ``path`` can be created or written as a file (``is_dir``: a directory)."""
    problem = writable_problem(key, str(path), "directory" if is_dir else "file")
    if problem is not None:
        problems.append(problem)
    return problem is None
