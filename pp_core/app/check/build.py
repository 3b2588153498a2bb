"""Build what ``pp-core run`` builds, before any process starts, and refuse what would fail there.

``run`` builds the model, the datasets and their batches, one optimizer per model part, and opens
the output files; each of these used to fail only on the ranks, after they started, with a
traceback. :func:`check_build` does the same work cheaply: the model on the meta device (no
memory), the dataset and its first batch (shapes checked against the model and ``pp_seq_len``,
one microbatch run through the meta model and the loss), the optimizer on the meta parameters,
and the resume path (every output path's writability: :mod:`pp_core.app.check.outputs`). Each
failure is one line naming the YAML key and the fix.
"""

from __future__ import annotations

import inspect
import os
import traceback
from pathlib import Path

from pp_core.app.adapters import adapted_meta_model
from pp_core.app.factories import EVALUATION_NOTE, call_factory, dataset_args, dp_slice
from pp_core.app.check.data import (check_labels, check_sequence_shards, check_vocab,
                                    meta_friendly)
from pp_core.app.check.fit import check_fit, check_memory
from pp_core.app.check.initializers import initializers_to_prepare
from pp_core.app.rendezvous import started_by_torchrun
from pp_core.app.check.returns import initializer_problem, loss_problem, output_problem
from pp_core.app.spec import Spec
from pp_core.errors import PluginError, PPCoreError, quoted, shorten
from pp_core.losses import resolve_loss
from pp_core.plugin_manager import plugins_or_default

__all__ = ["build_meta_model", "check_build", "check_local_ranks", "LOCAL_RANKS_PER_CPU"]

LOCAL_RANKS_PER_CPU = 8  # beyond this many processes per core a local launch cannot work


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {shorten(str(exc))}"


def _meta_limit(exc: BaseException) -> bool:
    """Whether an error is the meta device's limit (no values, no autocast: transformers 4.x's
    rotary embeddings enter ``torch.autocast(x.device.type)``), not the file's mistake."""
    return isinstance(exc, NotImplementedError) or \
        (isinstance(exc, RuntimeError) and ("meta" in str(exc).lower() or
                                            _raised_in(exc, "autocast_mode.py")))


def _raised_in(exc: BaseException, filename: str) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(filename)


def build_meta_model(spec: Spec, model_fn, problems: list[str], notes: list[str],
                     plugins=None):
    """The model built on the meta device, or ``None`` (a problem or a note says why)."""
    import torch  # lazy: torch, only with a model in hand

    from pp_core._torch_compat import nn_init_skipped

    key = "model.target" if spec.model.target is not None else "model.name"
    try:  # the call a rank makes (a plugin's factory through the plugin guard)
        with torch.device("meta"), nn_init_skipped():
            model = call_factory("model", spec, model_fn, spec.model.args, plugins)
    except Exception as exc:  # noqa: BLE001 - the factory refused the arguments, or meta did
        cause = exc.__cause__ if isinstance(exc, PluginError) else exc
        if cause is not None and _meta_limit(cause) and not isinstance(cause, PPCoreError):
            notes.append(f"split not checked: the model could not be built on the meta device "
                         f"({_why(cause)})")
        elif isinstance(exc, PluginError) and cause is not None:  # the guard's message
            problems.append(f"model.args: {exc}")
        elif isinstance(exc, PPCoreError):  # e.g. a missing optional dependency, named
            problems.append(f"{key}: {exc}")
        else:  # model.target: the user's own code
            problems.append(f"model.args: the model factory refused these arguments "
                            f"({_why(exc)}); fix model.args")
        return None
    if not isinstance(model, torch.nn.Module):
        problems.append(f"{key}: expected the factory to return a torch.nn.Module, found "
                        f"{type(model).__name__}")
        return None
    return adapted_meta_model(spec, model, problems)  # model.lora / model.freeze


def check_build(spec: Spec, model, data_fn, problems: list[str], notes: list[str],
                plugins=None):
    """The datasets, one batch, the optimizer and the resume path, as a rank would build them;
    returns the training data's first batch (``None`` without one)."""
    check_memory(spec, model, problems)
    batch = None
    if data_fn is not None:
        before = len(problems)
        batch = _check_dataset(spec, data_fn, False, problems, model, plugins)
        data_fits = len(problems) == before  # (its vocabulary, its processor's image token)
        if spec.train.eval_every:  # (its vocabulary once: eval data usually shares the tokenizer)
            evaluated = _check_dataset(spec, data_fn, True, problems,
                                       model if len(problems) == before else None, plugins)
            if evaluated is not None:
                check_fit(model, evaluated, "data.eval_args", problems)
                check_sequence_shards(spec, evaluated, "data.eval_args", problems)
        if batch is not None:
            check_fit(model, batch, "data.args", problems)
            check_labels(spec, batch, problems)
            if data_fits:  # data refused for the model is not run through it
                _check_batch(spec, model, batch, problems, notes, plugins)
    _check_optimizer(spec, model, problems)
    before = len(problems)
    _check_resume(spec, problems)
    if spec.checkpoint.resume and len(problems) == before:
        from pp_core.app.check.resume import check_resume_identity  # lazy: DCP, seconds

        check_resume_identity(spec, model, problems, notes)
    return batch


def _check_dataset(spec: Spec, data_fn, evaluation: bool, problems: list[str], model=None,
                   plugins=None):
    """The dataset's first batch, or ``None`` with a problem naming data.args (or eval_args)."""
    key = "data.eval_args" if evaluation else "data.args"
    why = EVALUATION_NOTE if evaluation else ""
    try:  # the call a rank makes (the plugin's factory through the plugin guard)
        data = call_factory("dataset", spec, data_fn, dataset_args(spec, data_fn, evaluation),
                            plugins, evaluation)
        check_vocab(data, model, key, problems)
        batch = next(iter(data))
    except StopIteration:
        problems.append(f"{key}: the dataset yields no batch{why}")
        return None
    except PluginError as exc:  # the guard's message: the arguments, or the plugin
        problems.append(f"{key}: {exc}")
        return None
    except Exception as exc:  # noqa: BLE001 - its first batch failed
        origin = plugins_or_default(plugins).origin("dataset", spec.data.name)
        problems.append(f"{key}: dataset {spec.data.name!r} refused these arguments{why} "
                        f"({_why(exc)}); fix {key}, or {origin} if the arguments are right")
        return None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        problems.append(f"data.name: dataset {spec.data.name!r} yielded "
                        f"{type(batch).__name__}, expected (inputs, target) pairs")
        return None
    return batch


def _check_batch(spec: Spec, model, batch, problems: list[str], notes: list[str],
                 plugins=None) -> None:
    """Shapes against the global batch and ``pp_seq_len``; one microbatch through the meta model."""
    import torch  # lazy: torch, only with a model in hand

    from pp_core.runtime.microbatch import first_tensor, kwargs_chunk_dims

    inputs, target = batch
    global_batch = spec.global_batch_size
    try:
        pieces = global_batch // spec.pipeline.pp_microbatch_size
        dims = kwargs_chunk_dims(model, inputs) if model is not None else None  # images by sample
        micro = [dp_slice(inputs, 0, pieces, global_batch, dims),
                 dp_slice(target, 0, pieces, global_batch)]
    except PPCoreError as exc:
        problems.append(f"data.args: {exc}")
        return
    first = first_tensor(inputs)
    if first is None:
        problems.append(f"data.args: a batch's inputs hold no tensor ({type(inputs).__name__}); "
                        f"a dataset yields (inputs, target) with inputs a tensor, tuple or dict "
                        f"of tensors")
        return
    if any(size == 0 for size in first.shape):
        problems.append(f"data.args: the dataset yields an empty batch (inputs of shape "
                        f"{tuple(first.shape)}); every dimension must be at least 1 (e.g. "
                        f"data.args.seq_len)")
        return
    check_sequence_shards(spec, batch, "data.args", problems)
    seq_len = spec.pipeline.pp_seq_len
    if seq_len is not None and (first.dim() < 2 or first.shape[1] != seq_len):
        found = f"sequence length {first.shape[1]}" if first.dim() >= 2 else \
            f"shape {tuple(first.shape)}"
        notes.append(f"pipeline.pp_seq_len: pp_seq_len={seq_len} is a hint, but the dataset "
                     f"yields {found}; the run still works (shapes are announced per step), "
                     f"set them equal to keep the pre-sized buffers' speed")
    if model is None:
        return
    from pp_core.runtime.microbatch import num_tokens  # lazy: torch, only with a model in hand

    meta = [to_meta(v) for v in micro]
    initializers = initializers_to_prepare(model, plugins_or_default(plugins), problems)
    if initializers is None:
        return
    for initializer in initializers:  # as the executor does before each microbatch
        problem = initializer_problem(initializer, num_tokens(meta[0]))
        if problem is not None:
            if problem.startswith("note: "):
                notes.append(problem[len("note: "):])
            else:
                problems.append(problem)
            return
    try:
        with torch.no_grad(), meta_friendly(model):
            output = model(*meta[0]) if isinstance(meta[0], tuple) else \
                model(**meta[0]) if isinstance(meta[0], dict) else model(meta[0])
        if isinstance(output, torch.Tensor):  # (a patched model's output is the split's)
            with torch.enable_grad():  # the loss must carry the gradient back to the model
                loss = resolve_loss(spec.pipeline.loss_fn)(
                    output.detach().requires_grad_(output.is_floating_point()), meta[1])
            problem = loss_problem(loss, output.is_floating_point())
            if problem is not None:
                problems.append(f"pipeline.loss_fn: {problem}")
        else:
            problem = output_problem(output)
            if problem is not None:
                problems.append(f"{'model.target' if spec.model.target else 'model.name'}"
                                f": {problem}")
    except Exception as exc:  # noqa: BLE001 - the model or loss refuses the data, or meta does
        if _meta_limit(exc):
            notes.append(f"one microbatch was not run on the meta device ({_why(exc)})")
        else:
            problems.append(f"data.args: a microbatch of this data fails in the model or the "
                            f"loss ({_why(exc)}); make data.args and model.args agree")


def to_meta(value):
    """``value`` with every tensor in it (through dicts, tuples, lists) moved to the meta device."""
    import torch  # lazy: torch, only with a model in hand

    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(to_meta(v) for v in value)
    return value


def _check_optimizer(spec: Spec, model, problems: list[str]) -> None:
    """Build the optimizer as a rank does (on meta parameters); refuse closure-only optimizers."""
    import torch  # lazy: torch, only with a model in hand

    options = dict(spec.train.optimizer)
    name = options.pop("name", None)
    cls = getattr(torch.optim, str(name), None)
    if not isinstance(cls, type):
        return  # spec.py already reported the name
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        problems.append(f"train.optimizer.name: torch.optim.{name} needs a closure that "
                        f"re-evaluates the loss, which a pipeline step cannot give it; use "
                        f"AdamW, Adam or SGD")
        return
    params = list(model.parameters()) if model is not None else []
    params = params or [torch.nn.Parameter(torch.empty(1, device="meta"))]
    try:
        cls(params, **options)
    except Exception as exc:  # noqa: BLE001 - torch.optim refused the file's arguments
        problems.append(f"train.optimizer: torch.optim.{name} refused these arguments "
                        f"({_why(exc)}); fix train.optimizer")


def _check_resume(spec: Spec, problems: list[str]) -> None:
    """The checkpoint a resume names exists and is complete (every data file there in full)."""
    from pp_core.checkpoint import latest_checkpoint, resume_checkpoint  # lazy: DCP, seconds

    resume = spec.checkpoint.resume
    if isinstance(resume, str) and not (Path(resume) / ".metadata").is_file():
        latest = latest_checkpoint(resume)
        hint = f"; did you mean {quoted(str(latest))} (its latest)?" if latest else \
            "; give a step_NNNNNNNN directory written by pp-core run, or resume: true"
        what = "does not exist" if not Path(resume).exists() else \
            "is not a complete checkpoint (no .metadata file)"
        problems.append(f"checkpoint.resume: {quoted(resume)} {what}{hint}")
        return
    try:
        resume_checkpoint(spec.checkpoint.dir, resume, spec.checkpoint.verify)
    except PPCoreError as exc:
        problems.append(f"checkpoint.resume: {exc}")


def check_local_ranks(spec: Spec, problems: list[str]) -> None:
    """Refuse a local launch of more processes than this machine could run (not under torchrun,
    where the launcher's world size decides)."""
    if started_by_torchrun():
        return
    dims, nnodes = spec.dims, spec.distributed.max_nodes
    local = dims.world_size // nnodes
    bound = LOCAL_RANKS_PER_CPU * (os.cpu_count() or 1)
    if local > bound:
        problems.append(f"distributed.{dims.largest_key()}: {dims.formula()} / nnodes = "
                        f"{dims.figures()} / {nnodes} = {local:,} processes on this "
                        f"machine, more than it can run ({LOCAL_RANKS_PER_CPU} per CPU core, "
                        f"{bound}); use smaller sizes, or more machines (distributed.nnodes)")
