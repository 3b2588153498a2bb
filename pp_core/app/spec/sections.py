"""One frozen dataclass per section of a pipeline file: what a checked :class:`~pp_core.app.spec.Spec`
holds, read as attributes (``spec.train.steps``), and the one place each key is declared.

Each field is a key of the file, declared once with :func:`key`: its default, its checker
(:mod:`pp_core.app.spec.checkers`) and its line of documentation;
:data:`~pp_core.app.spec.schema.SCHEMA` is read from these fields, in their order. The
``pipeline`` section is :class:`~pp_core.config.PipelineConfig` itself (its keys follow from its
fields' types). A free-form mapping (``model.args``, ``data.args``, ``train.optimizer``, ...)
stays a ``dict``. Nothing here checks a value: :func:`pp_core.app.spec.parse_spec` does, before
building these.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from pp_core.app.spec.checkers import (activation_checkpointing, address, compile_options,
                                       endpoint, export_hf, flag, integer, lora, mapping,
                                       mixed_precision, nnodes, node_range, number, one_of,
                                       optional,
                                       param_dtype,
                                       patterns, port, positive_number, resume, text)
from pp_core.config import PipelineConfig
from pp_core.parallel.dims import ParallelDims

__all__ = ["ModelSpec", "DataSpec", "DistributedSpec", "TrainSpec", "CheckpointSpec",
           "OutputSpec", "SECTIONS", "key", "KEY", "file_name", "field_values"]

KEY = "pp_core.spec.key"
"""The field metadata entry :func:`key` fills: ``{check, doc, required, open_mapping}``."""
NAME = "pp_core.spec.name"
"""The field metadata entry naming the key in the file, where it differs from the field's."""


def file_name(declared) -> str:
    """The name in the file of a section field (a ``dataclasses.Field``)."""
    return declared.metadata.get(NAME) or declared.name


def field_values(kind: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` keyed by the file's names, keyed by the fields of the section ``kind``."""
    renamed = {file_name(f): f.name for f in fields(kind)}
    return {renamed.get(name, name): value for name, value in values.items()}


def key(default: Any, check: Callable[[Any], Any], doc: str, *, required: bool = False,
        open_mapping: bool = False, name: str | None = None) -> Any:
    """A section field that is a key of the file: its ``default`` (a mutable one is copied for
    each section made), its ``check``, one line of ``doc`` (``docs/yaml.md`` has one table row per
    key), whether the file must give it (``required``), and whether its value is a free mapping
    (``open_mapping``: ``model.args``, ``train.optimizer``). ``name``: the key's name in the
    file when it cannot be the field's (``checkpoint.async``, a Python keyword, is ``async_``)."""
    declared = {KEY: {"check": check, "doc": doc, "required": required,
                      "open_mapping": open_mapping}, NAME: name}
    if type(default).__hash__ is None:  # dict, list: what a dataclass refuses as a default
        return field(default_factory=lambda: copy.deepcopy(default), metadata=declared)
    return field(default=default, metadata=declared)


@dataclass(frozen=True)
class ModelSpec:
    name: str | None = key(None, optional(text), "a model registered by a plugin "
                           "(pp_register_models)")
    target: str | None = key(None, optional(text), "or an importable 'module:callable' (imports "
                             "code)")
    args: dict[str, Any] = key({}, mapping, "keyword arguments of the model factory",
                               open_mapping=True)
    splitter: str | None = key(None, optional(text), "a splitter plugin by name (default: chosen "
                               "automatically); balanced: profile before launch, split by "
                               "measured time")
    dtype: str | None = key(None, optional(param_dtype), "cast the built model's parameters and "
                            "buffers to this floating dtype before it is split (pipeline.dtype "
                            "never does)")
    lora: dict[str, Any] | None = key(  # pp_core.app.adapters
        None, optional(lora), "LoRA adapters built with peft: {r, alpha, dropout, "
        "target_modules, ...peft.LoraConfig fields}; the base is frozen")
    freeze: list[str] | None = key(None, optional(patterns), "parameters to freeze: fnmatch "
                                   "patterns of parameter or module FQNs (e.g. [tok_embeddings, "
                                   "layers.0])")


@dataclass(frozen=True)
class DataSpec:
    name: str | None = key(  # required in a file; None only before the check
        None, text, "a dataset registered by a plugin (pp_register_datasets)", required=True)
    args: dict[str, Any] = key({}, mapping, "keyword arguments of the dataset factory",
                               open_mapping=True)
    eval_args: dict[str, Any] = key({}, mapping, "overrides of args for evaluation (e.g. split: "
                                    "val)", open_mapping=True)


@dataclass(frozen=True)
class DistributedSpec:
    pp_size: int = key(2, integer(1), "pipeline ranks (stages are spread over them)")
    dp_shard: int = key(1, integer(1), "FSDP2 degree: each pipeline stage's parameters, "
                        "gradients and optimizer state are sharded over this many ranks")
    dp_replicate: int = key(1, integer(1), "replicas of the whole pipeline (DDP semantics; HSDP "
                            "together with dp_shard)")
    dp_size: int = key(1, integer(1), "dp_replicate * dp_shard; written alone (older files) it "
                       "means dp_replicate")  # dp_replicate * dp_shard once checked
    tp_size: int = key(1, integer(1), "tensor-parallel degree inside each stage (torch's "
                       "parallelize_module with the model's plan from the "
                       "pp_tensor_parallel_plan hook; the innermost mesh dimension)")
    sequence_parallel: bool = key(False, flag, "with tp_size > 1: also shard norms and the "
                                  "activations between blocks and stages along the sequence")
    ep_size: int = key(1, integer(1), "expert-parallel degree: each MoE layer's experts are "
                       "sharded over this many of the dp ranks (it divides dp_replicate * "
                       "dp_shard and num_experts; docs/experts.md)")
    world_size: int | None = key(None, optional(integer(1)), "processes of the job; with layout: "
                                 "fixed it must equal the product of the degrees, with layout: "
                                 "auto 'pp-core plan' searches its factorisations")
    layout: str = key("fixed", one_of("fixed", "auto"), "auto: 'pp-core plan FILE' ranks every "
                      "pp x dp_replicate x dp_shard x tp (x ep) layout of world_size processes "
                      "and -o writes the chosen one; 'pp-core run' plans it only with nnodes "
                      "'MIN:MAX', for each world the run may be given (docs/failures.md)")
    mixed_precision: dict[str, str] | None = key(
        None, optional(mixed_precision), "{param_dtype, reduce_dtype} of the dp engines (FSDP2's "
        "MixedPrecisionPolicy), e.g. bfloat16 / float32")
    backend: str = key("auto", one_of("auto", "gloo", "nccl"), "auto: nccl on CUDA, else gloo")
    device: str = key("auto", one_of("auto", "cpu", "cuda"), "auto: cuda when every rank on the "
                      "machine gets a GPU of its own, else cpu")
    nnodes: int | str = key(1, nnodes, "machines taking part; each runs the same command; "
                            "'MIN:MAX' (torchrun's elastic form): the run goes on at a smaller "
                            "dp when nodes are lost, and grows back (docs/failures.md)")
    nproc_per_node: int | None = key(None, optional(integer(1)), "ranks per machine; default "
                                     "pp_size * dp_replicate * dp_shard * tp_size / nnodes")
    node_rank: int | None = key(None, optional(integer(0)), "this machine's index (static "
                                "rendezvous); with c10d, a node_rank > 0 never hosts the store")
    master_addr: str = key("127.0.0.1", address, "address of the rendezvous host; loopback "
                           "unless you name another")
    master_port: int | None = key(None, optional(port), "its port; default a free port (one "
                                  "node)")
    rdzv_backend: str = key("c10d", one_of("c10d", "static"), "torchrun's rendezvous backend")
    rdzv_endpoint: str | None = key(None, optional(endpoint), "host:port; default "
                                    "master_addr:master_port")
    rdzv_id: str = key("pp-core", text, "the job id every node passes")
    timeout_s: int = key(300, integer(1, 10**9), "rendezvous and process-group timeout in "
                         "seconds")
    max_restarts: int = key(0, integer(0), "times torch's elastic agent starts every rank again "
                            "after a rank dies or hangs; each restart resumes from the latest "
                            "complete checkpoint of checkpoint.dir (docs/failures.md)")
    elastic_wait_s: int = key(10, integer(1, 3600), "with nnodes 'MIN:MAX': seconds a "
                              "rendezvous that has MIN nodes waits for more (torch's "
                              "last_call_timeout); a shrink waits this long for the lost node")

    @property
    def min_nodes(self) -> int:
        """The fewest machines the run goes on with (``MIN`` of ``nnodes: "MIN:MAX"``)."""
        return node_range(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        """The machines of the whole run, the ones its degrees are written for (``MAX``)."""
        return node_range(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """Whether the run may go on at fewer machines than its degrees are written for."""
        return self.min_nodes < self.max_nodes

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees of this section, as one value (the world size, the divisors,
        the meshes: :class:`~pp_core.parallel.dims.ParallelDims`)."""
        return ParallelDims.of(self)


@dataclass(frozen=True)
class TrainSpec:
    steps: int = key(100, integer(1), "optimizer steps")
    optimizer: dict[str, Any] = key({"name": "AdamW", "lr": 1e-3}, mapping, "{name: a torch.optim "
                                    "class, then its keyword arguments}", open_mapping=True)
    warmup_steps: int = key(0, integer(0), "linear learning-rate warm-up from 0")
    lr_decay: str = key("constant", one_of("constant", "linear", "cosine"), "learning-rate shape "
                        "after warm-up")
    min_lr_ratio: float = key(0.1, number(0.0, 1.0), "final lr / peak lr for linear or cosine")
    grad_clip: float | None = key(None, optional(positive_number), "clip the global gradient norm "
                                  "to this (> 0)")
    seed: int = key(0, integer(0, 2**64 - 1), "model initialisation and data order")
    log_every: int = key(10, integer(1), "steps between metric lines")
    eval_every: int | None = key(None, optional(integer(1)), "steps between evaluations "
                                 "(data.eval_args)")
    eval_steps: int = key(2, integer(1), "batches per evaluation")
    activation_checkpointing: dict[str, Any] = key(
        {"mode": "none", "every": 1}, activation_checkpointing, "{mode: none | full | selective | "
        "auto (chosen per stage by pp_schedule: auto), or a list with one mode per stage, every: "
        "N} per block (docs/activation_and_compile.md, docs/planning.md)")
    on_nonfinite: str = key("stop", one_of("stop", "skip"), "a step with a NaN/inf loss or "
                            "gradient norm: stop the run (exit 1) or skip its update "
                            "(docs/refuses.md)")
    compile: dict[str, Any] = key({"enabled": False}, compile_options, "{enabled: bool, mode, "
                                  "fullgraph, dynamic, backend}: torch.compile each block "
                                  "(docs/activation_and_compile.md)")


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str | None = key(None, optional(text), "where checkpoints go (one step_NNNNNNNN dir "
                          "each)")
    every: int | None = key(None, optional(integer(1)), "steps between checkpoints")
    save_final: bool = key(True, flag, "also save after the last step (when dir is set)")
    resume: bool | str = key(False, resume, "true: latest checkpoint in dir; or a checkpoint path")
    export_hf: dict | None = key(None, export_hf, "DIR or {dir: DIR, every: N}: the ranks write a "
                                 "save_pretrained directory at the end (every N steps: "
                                 "DIR/step_NNNNNNNN)")
    verify: bool = key(True, flag, "check every file's recorded checksum when a checkpoint is "
                       "resumed, loaded or exported (false skips it)")
    async_: bool = key(False, flag, "save with torch.distributed.checkpoint.async_save: staged "
                       "to host memory, written while training goes on (docs/failures.md)",
                       name="async")


@dataclass(frozen=True)
class OutputSpec:
    metrics: str | None = key(None, optional(text), "JSON-lines metrics file")
    trace: str | None = key(None, optional(text), "Chrome trace (chrome://tracing, Perfetto)")
    schedule_image: str | None = key(None, optional(text), "SVG of a steady step as measured, above the same step simulated")
    progress: str = key("auto", one_of("auto", "bar", "plain", "off"), "auto: a bar on a "
                        "terminal, plain lines otherwise")
    summary: bool = key(True, flag, "print the summary table at the end")
    tensorboard: str | None = key(None, optional(text), "TensorBoard log directory (needs the "
                                  "tensorboard extra)")


SECTIONS: dict[str, type] = {
    "model": ModelSpec, "data": DataSpec, "pipeline": PipelineConfig,
    "distributed": DistributedSpec, "train": TrainSpec, "checkpoint": CheckpointSpec,
    "output": OutputSpec,
}
"""The class of each section, in the file's order: the order of
:data:`~pp_core.app.spec.schema.SCHEMA`, which is read from these classes."""
