"""``PipelineConfig``: every knob of a pipeline, validated the moment it is built.

Everything that can be checked without a model is checked in ``__post_init__``; each message names
the field, the value found and what would fix it, and the error carries the field
(``ConfigError.field``). The fields are typed as ``docs/runtime.md`` lists them; the YAML
schema of the ``pipeline:`` section is derived from these types (:func:`field_types`) and from
each field's ``metadata["minimum"]``. Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Union

from pp_core.callables import resolve_callable
from pp_core.errors import ConfigError, about, did_you_mean
from pp_core.losses import get_loss

DEGREE_KEYS: dict[str, str] = {"pp": "pp_size", "dp_replicate": "dp_replicate",
                               "dp_shard": "dp_shard", "tp": "tp_size", "ep": "ep_size"}
"""Each parallel degree -> its key under ``distributed:`` in a pipeline file: the one list of
them (:attr:`pp_core.parallel.dims.ParallelDims.KEYS`; the planner, below ``parallel/``, fills
a plan's degrees from it)."""

if TYPE_CHECKING:
    import torch

__all__ = ["PipelineConfig", "resolve_dtype", "field_types", "field_specs", "FieldSpec",
           "TorchDtype", "is_auto"]


def is_auto(pp_schedule) -> bool:
    """Whether ``pp_schedule`` asks the planner to choose (``"auto"``, in any case)."""
    return isinstance(pp_schedule, str) and pp_schedule.lower() == "auto"


class TorchDtype:
    """Stands for ``torch.dtype`` in :func:`field_types`, which reads the annotations without
    importing torch."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_dtype(value: Any):
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float32"``, ``"bf16"``)."""
    if value is None:  # before torch: a spec without dtypes loads torch-free (schedule show)
        return None
    import torch  # lazy: torch, the core loads no torch

    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}.get(
            name, name
        )
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ConfigError(
        f"dtype={value!r} is not a torch dtype; use a torch.dtype or a name such as "
        f"'float32', 'bfloat16' or 'float16'"
    )


@dataclass
class PipelineConfig:
    """How to split, schedule and run a model as a pipeline.

    ``pp_batch_size`` samples per step are split into ``pp_batch_size // pp_microbatch_size``
    microbatches. ``pp_schedule`` names a schedule plugin (case-insensitive, torch's names are
    aliases) unless ``pp_schedule_csv`` gives a compute-only CSV, which overrides it (then
    ``pp_schedule`` may be None). ``layers_per_stage``, ``round_virtual_stages_to_pp_multiple``
    and ``module_fqns_per_model_part`` steer the split.
    ``patch_inner_model`` / ``patch_causal_lm_model`` make Hugging Face decoders stage-friendly.
    ``patch_stage_backward_maybe_with_nosync`` syncs data-parallel gradients once per step.
    ``dtype`` is the dtype of the floating tensors stages send and receive (NeMo AutoModel's
    meaning); parameters are never cast by it.
    ``scale_grads_in_schedule`` divides gradients by the number of microbatches (mean instead of
    sum). ``loss_fn(output, target)`` runs on the last stage. ``pp_seq_len`` is a sequence-length
    hint: receive buffers are pre-sized while batches have it, and a batch of another length
    still runs. ``module_fqns_per_model_part`` overrides the layer split (``layers_per_stage``
    is then ignored, with a warning) and may name a shared module in several parts. ``pp_recv_buffer_pool`` reuses receive buffers, keeping
    ``pp_recv_buffer_pool_slack`` spare buffer sets. An int field is >= 1 unless its
    ``metadata["minimum"]`` says otherwise. ``pp_seq_chunks`` cuts every microbatch into that
    many causal slices along the sequence, each a unit of the schedule (docs/long_sequences.md);
    ``"auto"``: the planner chooses it with the schedule (``pp_schedule="auto"``).
    """

    pp_schedule: str | None = "1f1b"
    pp_schedule_csv: str | None = None
    pp_microbatch_size: int = 1
    pp_batch_size: int = 1
    layers_per_stage: int | None = None
    round_virtual_stages_to_pp_multiple: Literal["up", "down"] | None = None
    module_fqns_per_model_part: list[list[str]] | None = None
    patch_inner_model: bool = True
    patch_causal_lm_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    dtype: torch.dtype | None = None
    scale_grads_in_schedule: bool = False
    loss_fn: Callable | str | None = None
    pp_seq_len: int | None = None
    pp_recv_buffer_pool: bool = False
    pp_recv_buffer_pool_slack: int = field(default=2, metadata={"minimum": 0})
    pp_seq_chunks: int | Literal["auto"] = 1

    def _check_seq_chunks(self) -> None:
        """``pp_seq_chunks``: an int >= 1 or ``"auto"`` (checked with every field), no CSV, and
        a divisor of ``pp_seq_len`` when that is given. ``"auto"`` is the planner's to choose
        (``pp_schedule: auto``, ``pp-core plan``): :func:`~pp_core.planning.plan.plan_pipeline`
        refuses it left unchosen."""
        chunks = self.pp_seq_chunks
        if chunks == "auto":
            chunks = 2  # any K > 1: a CSV cannot take it
        if chunks > 1 and self.pp_schedule_csv is not None:
            raise ConfigError(f"pp_seq_chunks={chunks} cannot run the CSV schedule "
                              f"{self.pp_schedule_csv!r}: a CSV orders whole microbatches; set "
                              f"pp_seq_chunks: 1 or name a schedule in pp_schedule",
                              field="pp_seq_chunks")
        seq = self.pp_seq_len
        if self.pp_seq_chunks != "auto" and chunks > 1 and seq is not None and (chunks > seq or seq % chunks):
            raise ConfigError(f"pp_seq_chunks={chunks} must divide pp_seq_len={seq} into equal "
                              f"slices; use a divisor of {seq} such as "
                              f"{max(d for d in range(1, min(chunks, seq) + 1) if seq % d == 0)}",
                              field="pp_seq_chunks")

    def __post_init__(self) -> None:
        if self.pp_schedule is None:
            if self.pp_schedule_csv is None:
                raise ConfigError(
                    "pp_schedule=None needs pp_schedule_csv: set one of the two, a schedule name "
                    "such as pp_schedule='1f1b' or a compute-only CSV file as pp_schedule_csv",
                    field="pp_schedule")
        elif not isinstance(self.pp_schedule, str) or not self.pp_schedule.strip():
            raise ConfigError(
                f"pp_schedule={self.pp_schedule!r} must be a schedule name such as '1f1b' (or "
                f"None with pp_schedule_csv); run 'pp-core plugins' to list the installed "
                f"schedules", field="pp_schedule")
        if is_auto(self.pp_schedule):
            self._check_auto()
        if self.pp_schedule_csv is not None and not isinstance(self.pp_schedule_csv, (str, bytes)) \
                and not hasattr(self.pp_schedule_csv, "__fspath__"):
            raise ConfigError(f"pp_schedule_csv={self.pp_schedule_csv!r} must be a path to a CSV "
                              f"file", field="pp_schedule_csv")
        for declared in field_specs():
            declared.check(getattr(self, declared.name))
        if self.pp_batch_size % self.pp_microbatch_size:
            lower = self.pp_batch_size - self.pp_batch_size % self.pp_microbatch_size
            raise ConfigError(
                f"pp_batch_size={self.pp_batch_size} is not divisible by "
                f"pp_microbatch_size={self.pp_microbatch_size}; use pp_batch_size="
                + (f"{lower} or " if lower else "") + f"{lower + self.pp_microbatch_size}, or a "
                f"pp_microbatch_size that divides {self.pp_batch_size}", field="pp_batch_size")
        with about("module_fqns_per_model_part"):
            self._check_fqns()
        self._check_seq_chunks()
        with about("dtype"):
            dtype = resolve_dtype(self.dtype)
            if dtype is not None and (not dtype.is_floating_point or dtype.itemsize < 2):
                raise ConfigError(f"dtype={self.dtype!r} is not a floating-point dtype stages "
                                  f"can send and receive (float8 is a storage format); "
                                  f"the tensors between stages need one: use 'float32', "
                                  f"'bfloat16' or 'float16'")
        with about("loss_fn"):
            self._check_loss()

    def _check_loss(self) -> None:
        if self.loss_fn is None:
            return
        if isinstance(self.loss_fn, str) and ":" not in self.loss_fn:
            if "." in self.loss_fn:  # kedro-style guess: a dotted path meant as module:attr
                module, _, attr = self.loss_fn.rpartition(".")
                raise ConfigError(
                    f"loss_fn={self.loss_fn!r} is neither a built-in loss nor a 'module:attr' "
                    f"string; did you mean '{module}:{attr}'?"
                )
            get_loss(self.loss_fn)  # a bare built-in name such as cross_entropy
        else:
            resolve_callable(self.loss_fn, "loss_fn")

    def _check_auto(self) -> None:
        """``pp_schedule="auto"``: the planner picks schedule, stages and split; nothing may fix
        them too (it would be silently overridden)."""
        for name in ("pp_schedule_csv", "module_fqns_per_model_part", "layers_per_stage"):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"pp_schedule='auto' chooses the schedule and the split, but {name} is set "
                    f"too; unset {name}, or name a schedule instead of 'auto'", field=name)

    def _check_fqns(self) -> None:
        parts = self.module_fqns_per_model_part
        if parts is None:
            return
        if not isinstance(parts, (list, tuple)) or not parts:
            raise ConfigError(
                f"module_fqns_per_model_part={parts!r} must be a non-empty list of lists of module "
                f"names, e.g. [['embed', 'layers.0'], ['layers.1', 'norm', 'output']]"
            )
        for index, part in enumerate(parts):
            if not isinstance(part, (list, tuple)) or not part:
                raise ConfigError(
                    f"module_fqns_per_model_part[{index}]={part!r} must be a non-empty list of "
                    f"module names; every model part needs at least one module"
                )
            for fqn in part:
                if not isinstance(fqn, str) or not fqn:
                    raise ConfigError(
                        f"module_fqns_per_model_part[{index}] contains {fqn!r}; module names "
                        f"must be non-empty strings such as 'layers.0'"
                    )

    @property
    def num_microbatches(self) -> int:
        return self.pp_batch_size // self.pp_microbatch_size

    @property
    def torch_dtype(self):
        return resolve_dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Every field and its value (a shallow copy; lists are copied)."""
        return {
            f.name: (list(map(list, v)) if f.name == "module_fqns_per_model_part" and v else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PipelineConfig":
        """Build from a mapping; an unknown key is refused with the closest valid one."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in names:
                hint = did_you_mean(key, names, before="; ")
                raise ConfigError(
                    f"unknown PipelineConfig field {key!r}{hint} (valid fields: {', '.join(names)})"
                )
        return cls(**values)


# ----------------------------------------------------------------------------- declared types

_TORCH_NAMES = type("torch", (), {"dtype": TorchDtype})  # the name the annotations use


@functools.lru_cache(maxsize=1)
def field_types() -> dict[str, Any]:
    """Every field's annotation, evaluated (``torch.dtype`` read as :class:`TorchDtype`)."""
    return typing.get_type_hints(PipelineConfig, localns={"torch": _TORCH_NAMES})


@dataclass(frozen=True)
class FieldSpec:
    """A field as its annotation declares it: the kind both the config and the YAML schema
    check (``bool``, ``int`` with its minimum, ``"choice"`` of a ``Literal``, ``str``; ``None``
    for the types :class:`PipelineConfig` checks with its own messages: ``str`` fields included,
    :meth:`check` leaves them to it), and whether ``None`` is allowed."""

    name: str
    kind: Any
    optional: bool
    default: Any
    choices: tuple = ()
    minimum: int = 1

    def check(self, value) -> None:
        """Raise the field's :class:`ConfigError` when ``value`` is not of the declared kind."""
        if (value is None and self.optional) or self.kind is None:
            return
        if self.kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{self.name}={value!r} must be True or False", field=self.name)
        if self.kind is int and (not _is_int(value) or value < self.minimum):
            want = "a positive int (>= 1)" if self.minimum == 1 else \
                f"an int >= {self.minimum} (a bool is not accepted); use e.g. {self.default}"
            raise ConfigError(f"{self.name}={value!r} must be {want}", field=self.name)
        if self.kind == "int_or_auto" and value != "auto" and \
                (not _is_int(value) or value < self.minimum):
            raise ConfigError(f"{self.name}={value!r} must be a positive int (>= 1) or 'auto'",
                              field=self.name)
        if self.kind == "choice" and value not in self.choices:
            options = (["None"] if self.optional else []) + [repr(c) for c in self.choices]
            raise ConfigError(f"{self.name}={value!r} must be {', '.join(options[:-1])} or "
                              f"{options[-1]}", field=self.name)


@functools.lru_cache(maxsize=1)
def field_specs() -> tuple[FieldSpec, ...]:
    """:class:`FieldSpec` of every field, in field order."""
    specs = []
    for declared in dataclasses.fields(PipelineConfig):
        hint, optional = field_types()[declared.name], False
        args = typing.get_args(hint)
        if type(None) in args and typing.get_origin(hint) in (Union, types.UnionType):
            optional = True
            rest = tuple(a for a in args if a is not type(None))
            hint = rest[0] if len(rest) == 1 else Union[rest]
        kind, choices = (hint, ()) if hint in (bool, int, str) else (None, ())
        if hint == (int | Literal["auto"]):
            kind, choices = "int_or_auto", ("auto",)
        if typing.get_origin(hint) is Literal:
            kind, choices = "choice", typing.get_args(hint)
        specs.append(FieldSpec(declared.name, kind, optional, declared.default, choices,
                               declared.metadata.get("minimum", 1)))
    return tuple(specs)
