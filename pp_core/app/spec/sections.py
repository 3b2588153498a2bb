"""One frozen dataclass per section of a pipeline file: what a checked :class:`~pp_core.app.spec.Spec`
holds, read as attributes (``spec.train.steps``).

The fields are the keys of :data:`pp_core.app.spec.schema.SCHEMA`, with its defaults (a test keeps
the two equal). The ``pipeline`` section is :class:`~pp_core.config.PipelineConfig` itself. A
free-form mapping (``model.args``, ``data.args``, ``train.optimizer``, ...) stays a ``dict``.
Nothing here checks a value: :func:`pp_core.app.spec.parse_spec` does, before building these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pp_core.config import PipelineConfig
from pp_core.parallel.dims import ParallelDims

__all__ = ["ModelSpec", "DataSpec", "DistributedSpec", "TrainSpec", "CheckpointSpec",
           "OutputSpec", "SECTIONS"]


def _dict(**default: Any):
    return field(default_factory=lambda: dict(default))


@dataclass(frozen=True)
class ModelSpec:
    name: str | None = None
    target: str | None = None
    args: dict[str, Any] = _dict()
    splitter: str | None = None
    dtype: str | None = None
    lora: dict[str, Any] | None = None  # pp_core.app.adapters
    freeze: list[str] | None = None


@dataclass(frozen=True)
class DataSpec:
    name: str | None = None  # required in a file; None only before the check
    args: dict[str, Any] = _dict()
    eval_args: dict[str, Any] = _dict()


@dataclass(frozen=True)
class DistributedSpec:
    pp_size: int = 2
    dp_shard: int = 1
    dp_replicate: int = 1
    dp_size: int = 1  # dp_replicate * dp_shard once checked
    tp_size: int = 1
    sequence_parallel: bool = False
    ep_size: int = 1
    world_size: int | None = None
    layout: str = "fixed"
    mixed_precision: dict[str, str] | None = None
    backend: str = "auto"
    device: str = "auto"
    nnodes: int = 1
    nproc_per_node: int | None = None
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "pp-core"
    timeout_s: int = 300

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees of this section, as one value (the world size, the divisors,
        the meshes: :class:`~pp_core.parallel.dims.ParallelDims`)."""
        return ParallelDims.of(self)


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 100
    optimizer: dict[str, Any] = _dict(name="AdamW", lr=1e-3)
    warmup_steps: int = 0
    lr_decay: str = "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float | None = None
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None
    eval_steps: int = 2
    activation_checkpointing: dict[str, Any] = _dict(mode="none", every=1)
    on_nonfinite: str = "stop"
    compile: dict[str, Any] = _dict(enabled=False)


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str | None = None
    every: int | None = None
    save_final: bool = True
    resume: bool | str = False
    export_hf: dict | None = None
    verify: bool = True


@dataclass(frozen=True)
class OutputSpec:
    metrics: str | None = None
    trace: str | None = None
    schedule_image: str | None = None
    progress: str = "auto"
    summary: bool = True
    tensorboard: str | None = None


SECTIONS: dict[str, type] = {
    "model": ModelSpec, "data": DataSpec, "pipeline": PipelineConfig,
    "distributed": DistributedSpec, "train": TrainSpec, "checkpoint": CheckpointSpec,
    "output": OutputSpec,
}
"""The class of each section, in the order of :data:`~pp_core.app.spec.schema.SCHEMA`."""
