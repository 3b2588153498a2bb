"""Every hook a pp-core plugin can implement. Each docstring is that hook's documentation.

A plugin is a module (or any object) whose functions carry ``@pp_core.hookimpl`` and whose names
match a hook below. Register it through the entry-point group ``pp_core`` in your package's
``pyproject.toml``; see ``docs/plugins.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import pluggy

if TYPE_CHECKING:  # heavy imports only for type checkers
    import torch
    from torch import nn

    from pp_core.config import PipelineConfig
    from pp_core.initializer import PipelineRuntimeInitializer

__all__ = [
    "hookspec",
    "hookimpl",
    "pp_register_schedules",
    "pp_register_splitters",
    "pp_register_models",
    "pp_register_datasets",
    "pp_runtime_initializers",
    "pp_tensor_parallel_plan",
    "pp_expert_parallel_plan",
    "pp_make_recv_buffer_allocator",
    "pp_pipeline_step",
    "pp_report_metrics",
]

PROJECT_NAME = "pp_core"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ============================================================================ registries


@hookspec
def pp_register_schedules(register: Callable[[str, Any], None]) -> None:
    """Add schedules by calling ``register(name, schedule)`` once per schedule.

    :param register: ``register(name: str, schedule: ScheduleDef | Callable) -> None``.
        ``schedule`` is a :class:`pp_core.ScheduleDef` (generator, aliases, stage placement,
        stages per rank) or a bare generator
        ``generate(num_stages, num_microbatches, num_ranks) -> list[list[Action]]``, which means
        loop placement and one stage per rank. Names and aliases are case-insensitive.

    Calling: every implementation runs; a name or alias registered twice is an error naming both
    plugins. Built-ins: ``pp_core_builtins.schedules.*``.
    """


@hookspec
def pp_register_splitters(register: Callable[[str, Any], None]) -> None:
    """Add model splitters by calling ``register(name, splitter)`` once per splitter.

    :param register: ``register(name: str, splitter: Splitter) -> None``. A splitter has
        ``accepts(model) -> bool`` (may it split this model when no splitter is named?) and
        ``split(model, num_stages, config) -> list[list[str]]`` (the module FQNs of each stage,
        in stage order); optional ``priority`` (int, default 0), ``num_layers(model)``,
        ``make_part(model, fqns, stage_index, num_stages, config)`` and ``units(model)`` (the
        pieces, in model order, a cost-balanced split may move: ``pp_core.planning.units``).
        Automatic selection tries splitters by descending ``priority`` (built-ins: fqn 300,
        layers 200, sequential 100, balanced -1000), ties in registration order; see
        ``docs/splitting.md``.

    Calling: every implementation runs; a name registered twice is an error naming both plugins.
    Built-ins: ``pp_core_builtins.splitters.fqn``, ``pp_core_builtins.splitters.sequential``,
    ``pp_core_builtins.splitters.layers``, ``pp_core_builtins.splitters.balanced``.
    """


@hookspec
def pp_register_models(register: Callable[[str, Callable[..., "nn.Module"]], None]) -> None:
    """Add models a YAML pipeline can name, by calling ``register(name, factory)``.

    :param register: ``register(name: str, factory) -> None``; ``factory(**model.args)`` returns
        an ``nn.Module``.

    Calling: every implementation runs; a name registered twice is an error naming both plugins.
    Built-ins: ``pp_core_builtins.models``.
    """


@hookspec
def pp_register_datasets(register: Callable[[str, Callable[..., Iterable]], None]) -> None:
    """Add datasets a YAML pipeline can name, by calling ``register(name, factory)``.

    :param register: ``register(name: str, factory) -> None``; ``factory(**data.args)`` returns
        an iterable of ``(inputs, target)`` pairs, each one whole training step's batch (leading
        dimension = the global batch size; ``inputs`` a tensor, or a tuple or dict of tensors).

    Optional, what the run asks of the iterable when it is there:

    * ``skip(n)``: a resumed run at step ``n`` calls ``dataset.skip(n)`` and then iterates, so
      the first batch is the ``n``-th; without it the run iterates and drops ``n`` batches.
    * packed rows: ``inputs = {"input_ids": [B, S], "position_ids": [B, S]}`` whose position
      ids restart at 0 where a document starts (and at each row's start); a document starts
      wherever a position id is not its predecessor's plus one, and a target whose token belongs
      to another document is ``-100``. The ids are split by microbatch like the input ids, reach
      every stage with the activations, and give the step's ``docs`` figure (docs/data.md).

    Calling: every implementation runs; a name registered twice is an error naming both plugins.
    Built-ins: ``pp_core_builtins.models``.
    """


# ============================================================================ model


@hookspec
def pp_runtime_initializers(
    module: "nn.Module",
) -> Optional[Iterable["PipelineRuntimeInitializer"]]:
    """Return the runtime initializers ``module`` needs before each microbatch, or ``None``.

    :param module: one module of a model part (every module of every part is asked, in
        traversal order).
    :returns: an iterable of :class:`pp_core.runtime.PipelineRuntimeInitializer`, or ``None``.

    Calling: every implementation runs; the results of all plugins are combined, then
    de-duplicated by ``resource_key`` (see ``collect_pipeline_runtime_initializers``). A built-in
    implementation returns ``module.pipeline_runtime_initializers()`` when the module defines it,
    else NeMo AutoModel's ``module.get_pipeline_runtime_initializers()``.
    """


@hookspec(firstresult=True)
def pp_expert_parallel_plan(model: "nn.Module") -> Optional[dict[str, Any]]:
    """Return the expert-parallel plan of ``model`` (a whole model or one model part), or ``None``.

    :param model: the model, or one of this rank's model parts (same class and FQNs).
    :returns: ``{module pattern: style}``: patterns of module FQNs relative to ``model``, matched
        as a tensor-parallel plan's are (``*`` matches one name: ``"layers.*.moe"``), each mapped
        to an object with
        ``apply(module, ep_group) -> None`` that shards that module's experts over the
        expert-parallel process group in place (it keeps this rank's experts, marks their
        parameters ``pp_expert_parallel = True`` and dispatches tokens with all-to-all); or
        ``None`` to pass.

    Calling: first non-``None`` result wins (a model package answers for its own models);
    ``pp_core.parallel.apply_expert_parallel`` asks it for each model part (a part without a plan
    is left alone; no plan for any part is refused). Built-in: the core plugin returns
    ``model.expert_parallel_plan()`` when the model defines it (``moe_gpt``), after every other
    plugin; ``pp_core_builtins.transformers`` answers for Hugging Face MoE decoders.
    """


@hookspec(firstresult=True)
def pp_tensor_parallel_plan(model: "nn.Module", sequence_parallel: bool) -> Optional[dict]:
    """Return the tensor-parallel plan for ``model`` when this plugin knows it, else ``None``.

    :param model: the whole model (``pp-core validate``) or one model part of this rank (a part
        keeps the model's class and FQNs, with the modules of other stages removed or ``None``).
    :param sequence_parallel: ``distributed.sequence_parallel``: also shard the activations
        between the matmuls (norms, dropout) along the sequence (``SequenceParallel``).
    :returns: a ``torch.distributed.tensor.parallel.parallelize_module`` plan,
        ``{module path relative to model: ParallelStyle}`` (``*`` matches one name, e.g.
        ``layers.*.qkv``); entries whose module a part does not hold are skipped. ``None``: not
        a model this plugin knows.

    Calling: first non-``None`` result wins (the last registered plugin is asked first). Used
    by ``pp_core.parallel.apply_tensor_parallel`` and ``distributed.tp_size > 1``; a model no
    plugin has a plan for is refused by ``pp-core validate``. Built-ins: the core plugin returns
    ``model.tensor_parallel_plan(sequence_parallel)`` when the model defines it (after every
    other plugin), ``pp_core_builtins.models`` (``gpt``, ``uneven_gpt``),
    ``pp_core_builtins.transformers``.
    """


# ============================================================================ runtime


@hookspec(firstresult=True)
def pp_make_recv_buffer_allocator(
    config: "PipelineConfig", program: Any, rank: int, device: "torch.device"
) -> Optional[Any]:
    """Create the allocator this rank's runtime takes its point-to-point receive buffers from.

    :param config: the pipeline configuration (``pp_recv_buffer_pool``, ``..._slack``).
    :param program: this rank's lowered program, with each receive buffer's lifetime.
    :param rank: this rank's index in the pipeline group.
    :param device: where the buffers live.
    :returns: an allocator (see ``pp_core.runtime.allocator``), or ``None`` to pass.

    Calling: first non-``None`` result wins; with none, the runtime allocates one buffer per
    microbatch and direction, as torch does. Built-in: ``pp_core_builtins.buffer_pool`` (when
    ``pp_recv_buffer_pool=True``).
    """


@hookspec(firstresult=True)
def pp_pipeline_step(pipeline: Any, training: bool) -> Optional[Any]:
    """Wrap every ``Pipeline.step`` (``training=True``) and ``eval_step`` (``False``) on each rank.

    :param pipeline: the :class:`pp_core.runtime.Pipeline` running the step (its
        ``model_parts``, ``stage_indices``, ``schedule``, ``rank``, ``group``).
    :param training: whether the step runs backward.

    Implement it only as ``@hookimpl(wrapper=True)``: code before ``result = yield`` runs before
    the step's first action, code after it once the step's last action is done (gradients
    complete); ``result`` is what the step returns on this rank, and the wrapper must
    ``return result``. If the step fails, ``yield`` raises. A plain (non-wrapper)
    implementation is refused: it could replace the step.
    Use it for work that spans stages once per step — summing the gradients of weights tied
    across stages (``pp_core_builtins.transformers`` does), counting, timing. A wrapper may talk to the
    pipeline's peers over ``pipeline.group``; it runs on every rank, so every rank must agree on
    what it sends.

    Calling: every implementation runs, on every rank, nested around the step (the last
    registered outermost).
    """


# ============================================================================ application


@hookspec
def pp_report_metrics(step: int, metrics: dict[str, Any]) -> None:
    """Receive the figures of one logged step of ``pp-core run`` (TensorBoard, W&B, ...).

    :param step: the 1-based training step the figures belong to.
    :param metrics: what ``output.metrics`` gets for that step, without ``step``: after a
        training step ``loss`` (mean microbatch loss over the global batch), ``tokens_per_s``,
        ``step_time_s``, ``lr``, ``grad_norm`` (``None`` without clipping) and ``time`` (Unix
        seconds at the step's start); after an evaluation ``eval_loss``.

    Calling: every implementation runs, on the first rank of the run only (the one that writes
    ``output.metrics``), once per logged step (``train.log_every``, the first and the last step)
    and once per evaluation, whether or not ``output.metrics`` is set. An implementation that
    raises is logged (logger ``pp_core.plugin_manager``, naming the plugin) and not called again
    for the rest of the run; the run goes on.
    """
