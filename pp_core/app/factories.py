"""The model and dataset factories a spec names, and the arguments the dataset gets.

One module, used by ``pp-core validate`` (:mod:`pp_core.app.preflight`) and by every training
process (:mod:`pp_core.app.train`), so what validation checks is exactly what a run builds.
"""

from __future__ import annotations

import inspect
from typing import Callable

from pp_core.app.spec import Spec
from pp_core.callables import resolve_callable
from pp_core.errors import ConfigError, quoted
from pp_core.plugin_manager import plugins_or_default

__all__ = ["model_factory", "dataset_factory", "dataset_args", "accepts"]


def model_factory(spec: Spec, plugins=None) -> Callable:
    """The callable that builds the model: a registered name, or ``model.target`` (imports code)."""
    if spec.model["target"] is not None:
        target = resolve_callable(spec.model["target"], "model.target")
        if not (inspect.isclass(target) or inspect.isfunction(target)):
            raise ConfigError(f"model.target={quoted(spec.model['target'])} names a "
                              f"{type(target).__name__}, not a class or a Python function; "
                              f"validate and run call it with model.args, so name your model's "
                              f"class or factory function")
        return target
    return plugins_or_default(plugins).models.get(spec.model["name"])


def dataset_factory(spec: Spec, plugins=None) -> Callable:
    """The registered dataset factory ``data.name``."""
    return plugins_or_default(plugins).datasets.get(spec.data["name"])


def accepts(factory: Callable, name: str) -> bool:
    """Whether ``factory`` takes a keyword argument ``name`` (or any, through ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def dataset_args(spec: Spec, factory: Callable, evaluation: bool = False) -> dict:
    """``data.args`` (with ``data.eval_args`` over them for evaluation), plus the global batch size.

    Every dataset yields whole-step batches of ``pp_batch_size * dp_size`` samples; a factory
    that takes ``batch_size`` gets it filled in when the YAML leaves it out.
    """
    args = dict(spec.data["args"])
    if evaluation:
        args.update(spec.data["eval_args"])
    if "batch_size" not in args and accepts(factory, "batch_size"):
        args["batch_size"] = spec.global_batch_size
    return args
