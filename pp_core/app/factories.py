"""The model and dataset factories a spec names, and the arguments the dataset gets.

One module, used by ``pp-core validate`` (:mod:`pp_core.app.check`) and by every training
process (:mod:`pp_core.app.rank`), so what validation checks is exactly what a run builds. A
factory a plugin registered is called through the plugin guard
(:func:`pp_core.plugin_faults.factory_call`): one that raises is one error naming the YAML key,
the model or dataset, its plugin and distribution - at validate and on the ranks alike.
"""

from __future__ import annotations

import inspect
from typing import Callable

from pp_core.app.adapters import apply_adapters
from pp_core.app.spec import Spec
from pp_core.callables import resolve_callable
from pp_core.errors import ConfigError, PipelineError, quoted
from pp_core.plugin_faults import factory_call
from pp_core.plugin_manager import plugins_or_default

__all__ = ["model_factory", "build_model", "dataset_factory", "dataset_args", "accepts",
           "dp_slice", "call_factory", "build_dataset", "EVALUATION_NOTE"]

EVALUATION_NOTE = " (train.eval_every is set, so evaluation builds it)"


def model_factory(spec: Spec, plugins=None) -> Callable:
    """The callable that builds the model: a registered name, or ``model.target`` (imports code)."""
    if spec.model.target is not None:
        target = resolve_callable(spec.model.target, "model.target")
        if not (inspect.isclass(target) or inspect.isfunction(target)):
            raise ConfigError(f"model.target={quoted(spec.model.target)} names a "
                              f"{type(target).__name__}, not a class or a Python function; "
                              f"validate and run call it with model.args, so name your model's "
                              f"class or factory function")
        return target
    return plugins_or_default(plugins).models.get(spec.model.name)


def build_model(spec: Spec, plugins=None):
    """The spec's model as every rank builds it: ``train.seed`` set, then the factory called
    with ``model.args`` (on torch's current default device: a ``with torch.device("meta")``
    around the call builds it without memory), ``model.lora`` / ``model.freeze`` applied
    (:mod:`pp_core.app.adapters`). The one recipe of the trainer and of everything
    that measures the model in the launching process, so both build the same model. Cast to
    ``model.dtype`` when the file sets it."""
    import torch  # lazy: torch, off the spec checks' light path

    torch.manual_seed(spec.train.seed)
    model = call_factory("model", spec, model_factory(spec, plugins), spec.model.args, plugins)
    if spec.model.dtype is not None:  # model.dtype; pipeline.dtype casts no parameter
        model = model.to(getattr(torch, spec.model.dtype))
    if spec.model.lora is not None or spec.model.freeze:  # adapters and frozen parts
        model = apply_adapters(model, spec.model.lora, spec.model.freeze,
                               spec.distributed.tp_size)
    return model


def dataset_factory(spec: Spec, plugins=None) -> Callable:
    """The registered dataset factory ``data.name``."""
    return plugins_or_default(plugins).datasets.get(spec.data.name)


def build_dataset(spec: Spec, plugins=None, evaluation: bool = False):
    """The spec's dataset (``data.eval_args`` over ``data.args`` for evaluation), as a rank
    builds it."""
    factory = dataset_factory(spec, plugins)
    return call_factory("dataset", spec, factory, dataset_args(spec, factory, evaluation),
                        plugins, evaluation)


def call_factory(kind: str, spec: Spec, factory: Callable, arguments: dict, plugins=None,
                 evaluation: bool = False):
    """``factory(**arguments)`` for the spec's ``kind`` (``model`` or ``dataset``): through the
    plugin guard when a plugin registered it; a ``model.target`` (the user's own code) is
    called as it is."""
    if kind == "model":
        if spec.model.target is not None:
            return factory(**arguments)
        origin = plugins_or_default(plugins).origin("model", spec.model.name)
        return factory_call(origin, "the model factory", "model.args", factory, arguments)
    origin = plugins_or_default(plugins).origin("dataset", spec.data.name)
    key = "data.eval_args" if evaluation else "data.args"
    return factory_call(origin, f"dataset {spec.data.name!r}", key, factory, arguments,
                        EVALUATION_NOTE if evaluation else "")


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
    args = dict(spec.data.args)
    if evaluation:
        args.update(spec.data.eval_args)
    if "batch_size" not in args and accepts(factory, "batch_size"):
        args["batch_size"] = spec.global_batch_size
    return args


def dp_slice(value, dp_rank: int, dp_size: int, global_batch: int, dims=None):
    """This dp rank's contiguous share of a global batch: :func:`split_batch`, the rule that
    splits microbatches (tensors, tuples, dicts), with a message about the dataset. ``dims``:
    the batch dim of dict keys whose batch is not on dim 0 (the model's
    ``get_pipeline_kwargs_chunk_dims``)."""
    from pp_core.runtime.microbatch import split_batch  # lazy: torch, only with a batch in hand

    def mismatch(path, tensor):
        found = "a scalar" if tensor.dim() == 0 else f"leading dimension {tensor.shape[0]}"
        return PipelineError(
            f"the dataset yielded a batch with {found}, expected the global batch size "
            f"pipeline.pp_batch_size * distributed.dp_size = {global_batch}; make the "
            f"dataset yield {global_batch} samples per step (data.args.batch_size)")

    return split_batch(value, dp_size, global_batch, mismatch, dims)[dp_rank]
