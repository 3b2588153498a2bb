"""The schema of a pipeline file: every section, key, default, checker and one line of docs.

Each key names its checker (:mod:`pp_core.app.spec.checkers`); ``docs/yaml.md`` has one table row
per key here (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pp_core.app.spec.checkers import (activation_checkpointing, address, anything, compile_options,
                                       endpoint, export_hf, flag, integer, lora, mapping,
                                       mixed_precision, number, one_of, optional, param_dtype,
                                       patterns, port, positive_number, resume, text)
from pp_core.config import field_specs

__all__ = ["Key", "SCHEMA", "REQUIRED_SECTIONS"]


@dataclass(frozen=True)
class Key:
    """One key of the schema: its checker, its default, and one line of documentation."""

    name: str
    check: Callable[[Any], Any]
    default: Any = None
    doc: str = ""
    required: bool = False
    open_mapping: bool = False  # its value is a free mapping (model.args, optimizer kwargs)


def _pipeline_keys() -> list[Key]:
    """``pipeline`` holds the :class:`~pp_core.config.PipelineConfig` fields, verbatim; each
    key's checker follows from the field's declared type (:func:`~pp_core.config.field_specs`)."""
    keys = []
    for declared in field_specs():
        if declared.kind is bool:
            check = flag
        elif declared.kind is int:
            check = integer(declared.minimum)
        elif declared.kind is str:
            check = text  # pp_schedule and pp_schedule_csv both None: PipelineConfig names it
        elif declared.kind == "choice":
            check = one_of(*declared.choices)
        else:
            check = anything  # PipelineConfig itself checks these
        if declared.optional and check is not anything:
            check = optional(check)
        keys.append(Key(declared.name, check, declared.default, f"PipelineConfig.{declared.name}"))
    return keys


SCHEMA: dict[str, list[Key]] = {
    "model": [
        Key("name", optional(text), None, "a model registered by a plugin (pp_register_models)"),
        Key("target", optional(text), None, "or an importable 'module:callable' (imports code)"),
        Key("args", mapping, {}, "keyword arguments of the model factory", open_mapping=True),
        Key("splitter", optional(text), None, "a splitter plugin by name (default: chosen "
            "automatically); balanced: profile before launch, split by measured time"),
        Key("dtype", optional(param_dtype), None, "cast the built model's parameters and "
            "buffers to this floating dtype before it is split (pipeline.dtype never does)"),
        Key("lora", optional(lora), None, "LoRA adapters built with peft: {r, alpha, dropout, "
            "target_modules, ...peft.LoraConfig fields}; the base is frozen"),
        Key("freeze", optional(patterns), None, "parameters to freeze: fnmatch patterns of "
            "parameter or module FQNs (e.g. [tok_embeddings, layers.0])"),
    ],
    "data": [
        Key("name", text, None, "a dataset registered by a plugin (pp_register_datasets)",
            required=True),
        Key("args", mapping, {}, "keyword arguments of the dataset factory", open_mapping=True),
        Key("eval_args", mapping, {}, "overrides of args for evaluation (e.g. split: val)",
            open_mapping=True),
    ],
    "pipeline": _pipeline_keys(),
    "distributed": [
        Key("pp_size", integer(1), 2, "pipeline ranks (stages are spread over them)"),
        Key("dp_shard", integer(1), 1, "FSDP2 degree: each pipeline stage's parameters, gradients "
            "and optimizer state are sharded over this many ranks"),
        Key("dp_replicate", integer(1), 1, "replicas of the whole pipeline (DDP semantics; HSDP "
            "together with dp_shard)"),
        Key("dp_size", integer(1), 1, "dp_replicate * dp_shard; written alone (older files) it "
            "means dp_replicate"),
        Key("tp_size", integer(1), 1, "tensor-parallel degree inside each stage (torch's "
            "parallelize_module with the model's plan from the pp_tensor_parallel_plan hook; the "
            "innermost mesh dimension)"),
        Key("sequence_parallel", flag, False, "with tp_size > 1: also shard norms and the "
            "activations between blocks and stages along the sequence"),
        Key("ep_size", integer(1), 1, "expert-parallel degree: each MoE layer's experts are sharded "
            "over this many of the dp ranks (it divides dp_replicate * dp_shard and num_experts; "
            "docs/experts.md)"),
        Key("world_size", optional(integer(1)), None, "processes of the job; with layout: "
            "fixed it must equal the product of the degrees, with layout: auto 'pp-core plan' "
            "searches its factorisations"),
        Key("layout", one_of("fixed", "auto"), "fixed", "auto: 'pp-core plan FILE' ranks every "
            "pp x dp_replicate x dp_shard x tp (x ep) layout of world_size processes and -o "
            "writes the chosen one; 'pp-core run' runs only fixed layouts"),
        Key("mixed_precision", optional(mixed_precision), None, "{param_dtype, reduce_dtype} "
            "of the dp engines (FSDP2's MixedPrecisionPolicy), e.g. bfloat16 / float32"),
        Key("backend", one_of("auto", "gloo", "nccl"), "auto", "auto: nccl on CUDA, else gloo"),
        Key("device", one_of("auto", "cpu", "cuda"), "auto",
            "auto: cuda when every rank on the machine gets a GPU of its own, else cpu"),
        Key("nnodes", integer(1), 1, "machines taking part; each runs the same command"),
        Key("nproc_per_node", optional(integer(1)), None, "ranks per machine; default "
            "pp_size * dp_replicate * dp_shard * tp_size / nnodes"),
        Key("node_rank", optional(integer(0)), None, "this machine's index (static rendezvous)"),
        Key("master_addr", address, "127.0.0.1", "address of the rendezvous host; loopback unless "
            "you name another"),
        Key("master_port", optional(port), None, "its port; default a free port (one node)"),
        Key("rdzv_backend", one_of("c10d", "static"), "c10d", "torchrun's rendezvous backend"),
        Key("rdzv_endpoint", optional(endpoint), None,
            "host:port; default master_addr:master_port"),
        Key("rdzv_id", text, "pp-core", "the job id every node passes"),
        Key("timeout_s", integer(1, 10**9), 300, "rendezvous and process-group timeout in seconds"),
    ],
    "train": [
        Key("steps", integer(1), 100, "optimizer steps"),
        Key("optimizer", mapping, {"name": "AdamW", "lr": 1e-3},
            "{name: a torch.optim class, then its keyword arguments}", open_mapping=True),
        Key("warmup_steps", integer(0), 0, "linear learning-rate warm-up from 0"),
        Key("lr_decay", one_of("constant", "linear", "cosine"), "constant",
            "learning-rate shape after warm-up"),
        Key("min_lr_ratio", number(0.0, 1.0), 0.1, "final lr / peak lr for linear or cosine"),
        Key("grad_clip", optional(positive_number), None,
            "clip the global gradient norm to this (> 0)"),
        Key("seed", integer(0, 2**64 - 1), 0, "model initialisation and data order"),
        Key("log_every", integer(1), 10, "steps between metric lines"),
        Key("eval_every", optional(integer(1)), None, "steps between evaluations (data.eval_args)"),
        Key("eval_steps", integer(1), 2, "batches per evaluation"),
        Key("activation_checkpointing", activation_checkpointing,
            {"mode": "none", "every": 1}, "{mode: none | full | selective | auto (chosen per stage "
            "by pp_schedule: auto), or a list with one mode per stage, every: N} per block "
            "(docs/activation_and_compile.md, docs/planning.md)"),
        Key("on_nonfinite", one_of("stop", "skip"), "stop", "a step with a NaN/inf loss or "
            "gradient norm: stop the run (exit 1) or skip its update (docs/refuses.md)"),
        Key("compile", compile_options, {"enabled": False}, "{enabled: bool, mode, fullgraph, "
            "dynamic, backend}: torch.compile each block (docs/activation_and_compile.md)"),
    ],
    "checkpoint": [
        Key("dir", optional(text), None, "where checkpoints go (one step_NNNNNNNN dir each)"),
        Key("every", optional(integer(1)), None, "steps between checkpoints"),
        Key("save_final", flag, True, "also save after the last step (when dir is set)"),
        Key("resume", resume, False, "true: latest checkpoint in dir; or a checkpoint path"),
        Key("export_hf", export_hf, None, "DIR or {dir: DIR, every: N}: the ranks write a "
            "save_pretrained directory at the end (every N steps: DIR/step_NNNNNNNN)"),
        Key("verify", flag, True, "check every file's recorded checksum when a checkpoint is "
            "resumed, loaded or exported (false skips it)"),
    ],
    "output": [
        Key("metrics", optional(text), None, "JSON-lines metrics file"),
        Key("trace", optional(text), None, "Chrome trace (chrome://tracing, Perfetto)"),
        Key("schedule_image", optional(text), None, "SVG timeline of the schedule"),
        Key("progress", one_of("auto", "bar", "plain", "off"), "auto",
            "auto: a bar on a terminal, plain lines otherwise"),
        Key("summary", flag, True, "print the summary table at the end"),
        Key("tensorboard", optional(text), None,
            "TensorBoard log directory (needs the tensorboard extra)"),
    ],
}
REQUIRED_SECTIONS = ("model", "data")
