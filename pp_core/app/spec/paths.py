"""One rule for the relative paths of a pipeline file: each is relative to the file's folder.

Every path a run reads or writes - ``pipeline.pp_schedule_csv``, ``checkpoint.dir``,
``checkpoint.resume``, ``checkpoint.export_hf``, every path under ``output``, and the arguments a
model or dataset factory declares as paths (``model.args.config``, ``data.args.files``,
``data.args.tokenizer``, ...) - is made absolute against the folder of the pipeline file when
:func:`~pp_core.app.spec.load_spec` reads it, ``--set`` values included (they are part of the
pipeline). So a file validates, runs, resumes and exports alike from any working directory, the
run's outputs land beside the file whoever starts it (``checkpoint.resume: true`` finds the
checkpoints the last run wrote), and everything downstream - the ranks, the checkpoint's record of
its inputs, an exported adapter's base model - holds absolute paths that work from anywhere.

A factory declares its path arguments with an attribute, ``factory.pp_path_args``: a tuple of
argument names, or a mapping from each name to the words that are not paths there
(``tokenized_text``: ``{"tokenizer": ("bytes",), ...}``). A ``"module:attr"`` that
``model.target`` or ``pipeline.loss_fn`` names is also looked for in the file's folder, after the
installed packages.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

__all__ = ["PATH_ARGS", "NOT_PATHS", "absolute", "resolve_paths", "path_arguments",
           "named_factories", "search_beside"]

PATH_ARGS = "pp_path_args"
"""The attribute of a model or dataset factory naming its arguments that are paths."""

NOT_PATHS = ("progress", "summary")
"""``output`` keys that are not paths; every other string under ``output`` is a file written."""


def absolute(value: Any, folder: str, words: tuple[str, ...] = ()) -> Any:
    """``value`` (a path, or a list of them) with each relative path joined to ``folder``,
    normalised; ``~`` expanded; ``words`` (names that are not paths), non-strings and absolute
    paths as they are."""
    if isinstance(value, (list, tuple)):
        return [absolute(v, folder, words) for v in value]
    if not isinstance(value, str) or not value or value in words or "\0" in value:
        return value
    path = os.path.expanduser(value)
    if os.path.isabs(path):
        return path
    joined = os.path.normpath(os.path.join(folder, path))
    return joined + os.sep if path.endswith(("/", os.sep)) else joined  # "logs/" names a folder


def path_arguments(factory: Callable | None) -> dict[str, tuple[str, ...]]:
    """``{argument: words that are not paths}`` a factory declares (:data:`PATH_ARGS`)."""
    try:
        declared = getattr(factory, PATH_ARGS, None) or ()
    except Exception:  # noqa: BLE001 - a factory that cannot load: the checks report it
        return {}
    if isinstance(declared, dict):
        return {name: tuple(words or ()) for name, words in declared.items()}
    return {name: () for name in declared}


def resolve_paths(spec, folder: str, model_factory: Callable | None = None,
                  dataset_factory: Callable | None = None):
    """``spec`` with every relative path it names made absolute against ``folder`` (the module
    docstring); the factories say which of ``model.args`` / ``data.args`` are paths."""
    checkpoint, output = spec.checkpoint, spec.output
    export = checkpoint.export_hf
    spec = spec.with_("checkpoint", dir=absolute(checkpoint.dir, folder),
                      resume=absolute(checkpoint.resume, folder),
                      export_hf=None if export is None else
                      {**export, "dir": absolute(export["dir"], folder)})
    spec = spec.with_("output", **{name: absolute(value, folder)
                                   for name, value in vars(output).items()
                                   if name not in NOT_PATHS})
    if isinstance(spec.pipeline.pp_schedule_csv, str):
        spec = spec.with_("pipeline", pp_schedule_csv=absolute(spec.pipeline.pp_schedule_csv,
                                                               folder))
    model_paths, data_paths = path_arguments(model_factory), path_arguments(dataset_factory)
    if model_paths:
        spec = spec.with_("model", args=_arguments(spec.model.args, model_paths, folder))
    if data_paths:
        spec = spec.with_("data", args=_arguments(spec.data.args, data_paths, folder),
                          eval_args=_arguments(spec.data.eval_args, data_paths, folder))
    return spec


def _arguments(args: dict, declared: dict[str, tuple[str, ...]], folder: str) -> dict:
    return {name: absolute(value, folder, declared[name]) if name in declared else value
            for name, value in args.items()}


def search_beside(spec, folder: str) -> None:
    """Let a ``"module:attr"`` of ``model.target`` / ``pipeline.loss_fn`` import a module kept
    beside the pipeline file: its folder joins ``sys.path``, last (an installed package of the same
    name wins; spawned ranks inherit ``sys.path``)."""
    named = [spec.model.target, spec.pipeline.loss_fn]
    if any(isinstance(ref, str) and ":" in ref for ref in named) and folder not in sys.path:
        sys.path.append(folder)


def named_factories(spec) -> tuple[Callable | None, Callable | None]:
    """The model and the dataset factory ``spec`` names, each ``None`` where the name is unknown
    or the factory does not load (``validate`` reports those, naming the key)."""
    from pp_core.callables import resolve_callable  # lazy: model.target imports the user's code
    from pp_core.plugin_manager import plugins_or_default  # lazy: plugins load with a file read

    def found(lookup: Callable[[], Callable]) -> Callable | None:
        try:
            return lookup()
        except Exception:  # noqa: BLE001 - unknown or broken: the checks say which and why
            return None

    plugins = plugins_or_default(None)
    model = found(lambda: resolve_callable(spec.model.target, "model.target")
                  if spec.model.target else plugins.models.get(spec.model.name))
    data = found(lambda: plugins.datasets.get(spec.data.name))
    return model, data
