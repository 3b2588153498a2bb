"""The one order the parallelisms compose in: :func:`parallelize`, and :func:`after_step`.

torchtitan's ``parallelize_llama`` order, written once: tensor parallelism right after the split
(``parallelize_module`` must see plain modules), expert parallelism (the experts sharded before
anything wraps them), activation checkpointing, ``torch.compile`` (around the checkpointed
blocks), and the data-parallel engine last (FSDP2 / HSDP / replication wraps what the others
made; expert shards are left to their own group). Each step is one package's ``apply`` on a mesh
of :class:`~pp_core.parallel.dims.Meshes`, so a new parallelism is one more step here, not a
line in every caller. ``pp-core run``, the measuring helpers, the benchmarks and the test cases
all call :func:`parallelize`.

After each training step, :func:`after_step` finishes what a parallelism leaves half done in the
gradients: TP's partial sums (a replicated parameter that saw sequence shards) and EP's experts
(averaged over the ranks holding the same experts). ``Pipeline.step`` calls it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from pp_core.errors import ConfigError
from pp_core.parallel.activation import apply_activation_checkpointing, apply_stage_checkpointing
from pp_core.parallel.compile import apply_compile
from pp_core.parallel.data_parallel import apply_data_parallel
from pp_core.parallel.dims import Meshes
from pp_core.parallel.expert import (apply_expert_parallel, expert_parameters,
                                     sync_expert_gradients)
from pp_core.parallel.tensor_parallel import apply_tensor_parallel, reduce_partial_gradients

__all__ = ["ParallelSettings", "Parallelized", "parallelize", "after_step"]

DATA_PARALLEL = ("auto", "replicate", "none")


@dataclass(frozen=True)
class ParallelSettings:
    """How to apply what the meshes' degrees ask for (the degrees themselves are the meshes').

    :param activation_checkpointing: ``"none"``, ``"full"``, ``"selective"``, or one of those
        per stage (a list indexed by stage, as the planner writes it).
    :param checkpoint_every: checkpoint every N-th block (``train.activation_checkpointing.every``).
    :param compile: ``torch.compile`` keyword arguments for every block; ``None``: no compile.
    :param data_parallel: ``"auto"`` (FSDP2 when ``dp_shard > 1``, HSDP with replicas too,
        else replication), ``"replicate"`` (full copies even over ``dp_shard``), ``"none"``
        (the caller wraps the parts with a dp engine of its own).
    :param mixed_precision: FSDP2's ``{param_dtype, reduce_dtype}`` (or a policy).
    :param reshard_after_forward: FSDP2's, for the data-parallel step.
    :param tensor_parallel_plan, expert_parallel_plan: a plan for every part; ``None``: each
        part's plan from the plugins (``pp_tensor_parallel_plan``, ``pp_expert_parallel_plan``).
    :param plugins: the :class:`~pp_core.plugin_manager.Plugins` asked for plans.
    """

    activation_checkpointing: Union[str, Sequence[str]] = "none"
    checkpoint_every: int = 1
    compile: Optional[Mapping[str, Any]] = None
    data_parallel: str = "auto"
    mixed_precision: Any = None
    reshard_after_forward: bool = False
    tensor_parallel_plan: Optional[dict] = None
    expert_parallel_plan: Optional[dict] = None
    plugins: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` did: modules sharded by TP and by EP, the FQNs of checkpointed
    and compiled blocks, and the data-parallel units holding parameters (each reduces its
    gradients once per step)."""

    tensor_parallel: int = 0
    expert_parallel: int = 0
    checkpointed: list = field(default_factory=list)
    compiled: list = field(default_factory=list)
    data_parallel_units: int = 0


def parallelize(pipe_or_parts, meshes: Optional[Meshes] = None,
                settings: Optional[ParallelSettings] = None, *,
                stages: Optional[Sequence[int]] = None) -> Parallelized:
    """Apply every parallelism ``meshes`` asks for to this rank's parts, in place, in one order:
    TP, EP, activation checkpointing, compile, data parallelism (module docstring).

    :param pipe_or_parts: a :class:`~pp_core.runtime.pipeline.Pipeline` or its ``model_parts``.
    :param meshes: what :meth:`ParallelDims.build <pp_core.parallel.dims.ParallelDims.build>`
        made; ``None``: one process per stage (checkpointing and compile only).
    :param stages: the parts' stage indices, for per-stage checkpointing modes (default: the
        pipeline's).
    """
    settings = settings or ParallelSettings()
    parts = getattr(pipe_or_parts, "model_parts", pipe_or_parts)
    stages = stages if stages is not None else getattr(pipe_or_parts, "stage_indices", None)
    num_stages = getattr(pipe_or_parts, "num_stages", None)
    if settings.data_parallel not in DATA_PARALLEL:
        raise ConfigError(f"ParallelSettings.data_parallel: expected one of "
                          f"{', '.join(DATA_PARALLEL)}, found {settings.data_parallel!r}")
    dims, plugins = meshes.dims if meshes is not None else None, settings.plugins
    tp = ep = units = 0
    if dims is not None and dims.tp > 1:  # right after the split, on plain modules
        tp = apply_tensor_parallel(parts, meshes.tp, settings.tensor_parallel_plan,
                                   sequence_parallel=dims.sequence_parallel, plugins=plugins)
    if meshes is not None and meshes.experts is not None:  # before AC, compile and dp wrap them
        ep = apply_expert_parallel(parts, meshes.ep_group, settings.expert_parallel_plan,
                                   plugins=plugins)
    checkpointed = _checkpoint(parts, settings, stages, num_stages)
    compiled = [] if settings.compile is None else apply_compile(parts, **settings.compile)
    if dims is not None and dims.dp > 1 and settings.data_parallel != "none":  # last
        shard = dims.dp_shard > 1 and settings.data_parallel == "auto"
        units = apply_data_parallel(parts, meshes.data_parallel_mesh(), shard=shard,
                                    reshard_after_forward=settings.reshard_after_forward,
                                    mixed_precision=settings.mixed_precision,
                                    ignored_params=expert_parameters(parts))
    return Parallelized(tp, ep, checkpointed, compiled, units)


def _checkpoint(parts, settings: ParallelSettings, stages, num_stages) -> list[str]:
    """One mode for every part, or each part by its own stage's mode."""
    mode, every = settings.activation_checkpointing, settings.checkpoint_every
    if isinstance(mode, str):
        if mode == "auto":
            raise ConfigError("train.activation_checkpointing.mode: auto is chosen by the planner "
                              "(pipeline.pp_schedule: auto, run with 'pp-core run'); set "
                              "pp_schedule: auto, or a mode (none, full, selective)")
        return apply_activation_checkpointing(parts, mode, every)
    if num_stages is not None and len(mode) != num_stages:
        raise ConfigError(
            f"train.activation_checkpointing.mode lists {len(mode)} modes, one per stage, "
            f"but the pipeline has {num_stages} stages; list {num_stages} modes, or give "
            f"one mode for every stage")
    if stages is None:
        raise ConfigError("parallelize: a mode per stage needs the parts' stage indices; pass "
                          "the pipeline, or stages=")
    return apply_stage_checkpointing(parts, stages, list(mode), every)


def after_step(parts, meshes: Optional[Meshes] = None) -> None:
    """Finish the step's gradients (every rank calls it after its last backward): TP's partial
    sums reduced to their parameters' placements, and with expert parallelism the experts'
    gradients averaged over the ranks holding the same experts."""
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    if any(hasattr(p, "device_mesh") for p in params):  # DTensors: tensor parallel
        reduce_partial_gradients(params)
    if meshes is not None and meshes.experts is not None:
        sync_expert_gradients(params, meshes.experts)
