"""The schema of a pipeline file: every section, key, default, checker and one line of docs.

Each checker takes the YAML value and returns it (normalised: ``1e-3`` read as a string becomes a
float) or raises :class:`Mismatch` saying what would have been accepted; :mod:`pp_core.app.spec` turns
that into ``key.path: expected ..., found ...``. ``docs/yaml.md`` has one table row per key here
(a test checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from pp_core.app.rendezvous import address_problem, port_problem, split_endpoint
from pp_core.config import field_specs, resolve_dtype
from pp_core.errors import ConfigError, did_you_mean, quoted

__all__ = ["Key", "SCHEMA", "REQUIRED_SECTIONS", "Mismatch", "describe_value"]


class Mismatch(Exception):
    """Raised by a checker: ``expected`` says what would have been accepted."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def describe_value(value: Any) -> str:
    """``'ten' (str)``: the value as found (cut short), with its YAML-visible type."""
    return f"{quoted(value, 60)} ({type(value).__name__})"


# ----------------------------------------------------------------------------- checkers


def _int(minimum: int | None = None, maximum: int | None = None) -> Callable:
    word = {0: "an int >= 0", 1: "a positive int"}.get(minimum, "an int")
    if maximum is not None:
        word = f"an int in [{minimum}, {maximum}]"

    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or \
                (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise Mismatch(word)
        return value
    return check


def _float(minimum: float | None = None, maximum: float | None = None) -> Callable:
    bounds = f" in [{minimum}, {maximum}]" if maximum is not None else \
        (f" >= {minimum}" if minimum is not None else "")

    def check(value):
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                raise Mismatch(f"a finite number{bounds}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise Mismatch(f"a finite number{bounds}")
        return float(value)
    return check


def _positive_float(value):
    """A finite number > 0 (``grad_clip: 0`` would zero every update)."""
    number = _float(0.0)(value)
    if number <= 0:
        raise Mismatch("a finite number > 0")
    return number


def _str(value):
    if not isinstance(value, str) or not value:
        raise Mismatch("a non-empty string")
    return value


def _bool(value):
    if not isinstance(value, bool):
        raise Mismatch("true or false")
    return value


def _mapping(value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Mismatch("a mapping (key: value lines)")
    return dict(value)


def _choice(*options: str) -> Callable:
    def check(value):
        if isinstance(value, bool) and "off" in options:  # YAML 1.1 reads `off` as false
            return "off" if not value else options[0]
        if not isinstance(value, str) or value.lower() not in options:
            hint = did_you_mean(str(value).lower(), options, before=" (", after=")")
            raise Mismatch(f"one of {', '.join(map(repr, options))}{hint}")
        return value.lower()
    return check


def _optional(inner: Callable) -> Callable:
    def check(value):
        return None if value is None else inner(value)
    check.__name__ = f"optional_{getattr(inner, '__name__', 'value')}"
    return check


def _resume(value):
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str) and value:
        return value
    raise Mismatch("true, false, or the path of a checkpoint directory")


def _export_hf(value):
    if value is None or value is False:
        return None
    if isinstance(value, str) and value:
        return {"dir": value, "every": None}
    if isinstance(value, dict) and isinstance(value.get("dir"), str) and value["dir"] \
            and set(value) <= {"dir", "every"}:
        every = value.get("every")
        if every is None or (isinstance(every, int) and not isinstance(every, bool) and every > 0):
            return {"dir": value["dir"], "every": every}
    raise Mismatch("a directory, or {dir: DIR, every: N} with N a positive int")


def _address(value):
    problem = address_problem(_str(value))
    if problem is not None:
        raise Mismatch(problem)
    return value


def _port(value):
    problem = port_problem(value)
    if problem is not None:
        raise Mismatch(problem)
    return value


def _endpoint(value):
    try:
        split_endpoint(_str(value))
    except ValueError as exc:
        raise Mismatch(str(exc)) from None
    return value


def _anything(value):
    return value


def _activation_checkpointing(value):
    """``{mode: none|full|selective|auto, every: N}``; ``mode`` may also be a list with one
    mode per stage (what the planner writes); a bare mode (or list) is accepted too."""
    if isinstance(value, (str, list)) or value is None or isinstance(value, bool):
        value = {"mode": "none" if not value else value}
    expected = ("a mapping {mode: none | full | selective | auto, or a list of none / full / "
                "selective with one entry per stage, every: a positive int}")
    if not isinstance(value, dict) or set(value) - {"mode", "every"}:
        raise Mismatch(expected)
    mode = value.get("mode", "full")
    every = value.get("every", 1)
    modes = mode if isinstance(mode, list) else [mode]
    allowed = ("none", "full", "selective") + (() if isinstance(mode, list) else ("auto",))
    if not modes or any(not isinstance(m, str) or m.lower() not in allowed for m in modes) or \
            isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise Mismatch(expected)
    lowered = [m.lower() for m in modes]
    return {"mode": lowered if isinstance(mode, list) else lowered[0], "every": every}


def _compile(value):
    """``{enabled: bool, ...torch.compile keyword arguments}``; ``true``/``false`` alone too."""
    if isinstance(value, bool) or value is None:
        return {"enabled": bool(value)}
    allowed = {"enabled", "mode", "fullgraph", "dynamic", "backend", "options"}
    if not isinstance(value, dict) or set(value) - allowed or \
            not isinstance(value.get("enabled", True), bool):
        raise Mismatch(f"true, false, or a mapping with keys {', '.join(sorted(allowed))} "
                       f"(enabled: a bool; the others go to torch.compile)")
    from pp_core.parallel.compile_options import compile_problem  # lazy: torch, only when set

    problem = compile_problem({k: v for k, v in value.items() if k != "enabled"})
    if problem is not None:
        raise Mismatch(f"torch.compile options ({problem})")
    return {"enabled": True, **value}


def _mixed_precision(value):
    """``{param_dtype, reduce_dtype}``: floating-point torch dtype names."""
    from pp_core.parallel.data_parallel import mixed_precision_policy  # lazy: torch, only when set

    expected = "a mapping {param_dtype, reduce_dtype} of float32, bfloat16 or float16"
    if not isinstance(value, dict) or not value or set(value) - {"param_dtype", "reduce_dtype"}:
        raise Mismatch(expected)
    try:
        mixed_precision_policy(value)
    except ConfigError:
        raise Mismatch(expected) from None
    return dict(value)


def _param_dtype(value):
    """A floating-point torch dtype name (``model.dtype``)."""
    expected = "a floating-point dtype name: float32, bfloat16, float16 or float64"
    try:
        dtype = resolve_dtype(value)
    except ConfigError:
        raise Mismatch(expected) from None
    if not dtype.is_floating_point:
        raise Mismatch(expected)
    if dtype.itemsize < 2:  # as pipeline.dtype: a storage format, no arithmetic on CPU or in Adam
        raise Mismatch(f"{expected} (float8 is a storage format the model cannot compute in)")
    return str(dtype).removeprefix("torch.")


def _lora(value):
    """``{r, alpha, dropout, target_modules, ...}``: peft.LoraConfig checks the rest."""
    expected = ("a mapping {r: a positive int, alpha: a number, dropout: 0 <= p < 1, "
                "target_modules: a list of module names, ...}")
    if not isinstance(value, dict) or any(not isinstance(k, str) for k in value):
        raise Mismatch(expected)
    r, dropout = value.get("r", 8), value.get("dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or isinstance(dropout, bool) or \
            not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise Mismatch(expected)
    return dict(value)


def _patterns(value):
    """A list of fnmatch patterns (one string alone too)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or \
            not all(isinstance(v, str) and v for v in items):
        raise Mismatch("a list of parameter or module name patterns, e.g. [tok_*, layers.0]")
    return list(items)


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
            check = _bool
        elif declared.kind is int:
            check = _int(declared.minimum)
        elif declared.kind is str:
            check = _str  # pp_schedule and pp_schedule_csv both None: PipelineConfig names it
        elif declared.kind == "choice":
            check = _choice(*declared.choices)
        else:
            check = _anything  # PipelineConfig itself checks these
        if declared.optional and check is not _anything:
            check = _optional(check)
        keys.append(Key(declared.name, check, declared.default, f"PipelineConfig.{declared.name}"))
    return keys


SCHEMA: dict[str, list[Key]] = {
    "model": [
        Key("name", _optional(_str), None, "a model registered by a plugin (pp_register_models)"),
        Key("target", _optional(_str), None, "or an importable 'module:callable' (imports code)"),
        Key("args", _mapping, {}, "keyword arguments of the model factory", open_mapping=True),
        Key("splitter", _optional(_str), None, "a splitter plugin by name (default: chosen "
            "automatically); balanced: profile before launch, split by measured time"),
        Key("dtype", _optional(_param_dtype), None, "cast the built model's parameters and "
            "buffers to this floating dtype before it is split (pipeline.dtype never does)"),
        Key("lora", _optional(_lora), None, "LoRA adapters built with peft: {r, alpha, dropout, "
            "target_modules, ...peft.LoraConfig fields}; the base is frozen"),
        Key("freeze", _optional(_patterns), None, "parameters to freeze: fnmatch patterns of "
            "parameter or module FQNs (e.g. [tok_embeddings, layers.0])"),
    ],
    "data": [
        Key("name", _str, None, "a dataset registered by a plugin (pp_register_datasets)",
            required=True),
        Key("args", _mapping, {}, "keyword arguments of the dataset factory", open_mapping=True),
        Key("eval_args", _mapping, {}, "overrides of args for evaluation (e.g. split: val)",
            open_mapping=True),
    ],
    "pipeline": _pipeline_keys(),
    "distributed": [
        Key("pp_size", _int(1), 2, "pipeline ranks (stages are spread over them)"),
        Key("dp_shard", _int(1), 1, "FSDP2 degree: each pipeline stage's parameters, gradients "
            "and optimizer state are sharded over this many ranks"),
        Key("dp_replicate", _int(1), 1, "replicas of the whole pipeline (DDP semantics; HSDP "
            "together with dp_shard)"),
        Key("dp_size", _int(1), 1, "dp_replicate * dp_shard; written alone (older files) it "
            "means dp_replicate"),
        Key("tp_size", _int(1), 1, "tensor-parallel degree inside each stage (torch's "
            "parallelize_module with the model's plan from the pp_tensor_parallel_plan hook; the "
            "innermost mesh dimension)"),
        Key("sequence_parallel", _bool, False, "with tp_size > 1: also shard norms and the "
            "activations between blocks and stages along the sequence"),
        Key("ep_size", _int(1), 1, "expert-parallel degree: each MoE layer's experts are sharded "
            "over this many of the dp ranks (it divides dp_replicate * dp_shard and num_experts; "
            "docs/composition.md)"),
        Key("world_size", _optional(_int(1)), None, "processes of the job; with layout: "
            "fixed it must equal the product of the degrees, with layout: auto 'pp-core plan' "
            "searches its factorisations"),
        Key("layout", _choice("fixed", "auto"), "fixed", "auto: 'pp-core plan FILE' ranks every "
            "pp x dp_replicate x dp_shard x tp (x ep) layout of world_size processes and -o "
            "writes the chosen one; 'pp-core run' runs only fixed layouts"),
        Key("mixed_precision", _optional(_mixed_precision), None, "{param_dtype, reduce_dtype} "
            "of the dp engines (FSDP2's MixedPrecisionPolicy), e.g. bfloat16 / float32"),
        Key("backend", _choice("auto", "gloo", "nccl"), "auto", "auto: nccl on CUDA, else gloo"),
        Key("device", _choice("auto", "cpu", "cuda"), "auto",
            "auto: cuda when every rank on the machine gets a GPU of its own, else cpu"),
        Key("nnodes", _int(1), 1, "machines taking part; each runs the same command"),
        Key("nproc_per_node", _optional(_int(1)), None, "ranks per machine; default "
            "pp_size * dp_replicate * dp_shard * tp_size / nnodes"),
        Key("node_rank", _optional(_int(0)), None, "this machine's index (static rendezvous)"),
        Key("master_addr", _address, "127.0.0.1", "address of the rendezvous host; loopback unless "
            "you name another"),
        Key("master_port", _optional(_port), None, "its port; default a free port (one node)"),
        Key("rdzv_backend", _choice("c10d", "static"), "c10d", "torchrun's rendezvous backend"),
        Key("rdzv_endpoint", _optional(_endpoint), None,
            "host:port; default master_addr:master_port"),
        Key("rdzv_id", _str, "pp-core", "the job id every node passes"),
        Key("timeout_s", _int(1, 10**9), 300, "rendezvous and process-group timeout in seconds"),
    ],
    "train": [
        Key("steps", _int(1), 100, "optimizer steps"),
        Key("optimizer", _mapping, {"name": "AdamW", "lr": 1e-3},
            "{name: a torch.optim class, then its keyword arguments}", open_mapping=True),
        Key("warmup_steps", _int(0), 0, "linear learning-rate warm-up from 0"),
        Key("lr_decay", _choice("constant", "linear", "cosine"), "constant",
            "learning-rate shape after warm-up"),
        Key("min_lr_ratio", _float(0.0, 1.0), 0.1, "final lr / peak lr for linear or cosine"),
        Key("grad_clip", _optional(_positive_float), None,
            "clip the global gradient norm to this (> 0)"),
        Key("seed", _int(0, 2**64 - 1), 0, "model initialisation and data order"),
        Key("log_every", _int(1), 10, "steps between metric lines"),
        Key("eval_every", _optional(_int(1)), None, "steps between evaluations (data.eval_args)"),
        Key("eval_steps", _int(1), 2, "batches per evaluation"),
        Key("activation_checkpointing", _activation_checkpointing,
            {"mode": "none", "every": 1}, "{mode: none | full | selective | auto (chosen per stage "
            "by pp_schedule: auto), or a list with one mode per stage, every: N} per block "
            "(docs/composition.md, docs/planning.md)"),
        Key("on_nonfinite", _choice("stop", "skip"), "stop", "a step with a NaN/inf loss or "
            "gradient norm: stop the run (exit 1) or skip its update (docs/refuses.md)"),
        Key("compile", _compile, {"enabled": False}, "{enabled: bool, mode, fullgraph, "
            "dynamic, backend}: torch.compile each block (docs/composition.md)"),
    ],
    "checkpoint": [
        Key("dir", _optional(_str), None, "where checkpoints go (one step_NNNNNNNN dir each)"),
        Key("every", _optional(_int(1)), None, "steps between checkpoints"),
        Key("save_final", _bool, True, "also save after the last step (when dir is set)"),
        Key("resume", _resume, False, "true: latest checkpoint in dir; or a checkpoint path"),
        Key("export_hf", _export_hf, None, "DIR or {dir: DIR, every: N}: the ranks write a "
            "save_pretrained directory at the end (every N steps: DIR/step_NNNNNNNN)"),
        Key("verify", _bool, True, "check every file's recorded checksum when a checkpoint is "
            "resumed, loaded or exported (false skips it)"),
    ],
    "output": [
        Key("metrics", _optional(_str), None, "JSON-lines metrics file"),
        Key("trace", _optional(_str), None, "Chrome trace (chrome://tracing, Perfetto)"),
        Key("schedule_image", _optional(_str), None, "SVG timeline of the schedule"),
        Key("progress", _choice("auto", "bar", "plain", "off"), "auto",
            "auto: a bar on a terminal, plain lines otherwise"),
        Key("summary", _bool, True, "print the summary table at the end"),
        Key("tensorboard", _optional(_str), None,
            "TensorBoard log directory (needs the tensorboard extra)"),
    ],
}
REQUIRED_SECTIONS = ("model", "data")
