"""``PipelineConfig``: every knob of a pipeline, validated the moment it is built.

Everything that can be checked without a model is checked in ``__post_init__``; each message names
the field, the value found and what would fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pp_core.errors import ConfigError

__all__ = ["PipelineConfig", "resolve_dtype", "resolve_callable"]

_ROUNDING = (None, "up", "down")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_dtype(value: Any):
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float32"``, ``"bf16"``)."""
    import torch

    if value is None or isinstance(value, torch.dtype):
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


def resolve_callable(value: Any, field_name: str = "loss_fn") -> Callable:
    """A callable from a callable or an importable ``"module:attr"`` string (imports code!)."""
    if callable(value):
        return value
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(
            f"{field_name}={value!r} is neither a callable nor a 'module:attr' string; pass a "
            f"function, or a string such as 'torch.nn.functional:cross_entropy'"
        )
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{field_name}={value!r}: cannot import module {module_name!r} ({exc}); check the "
            f"spelling or install the package that provides it"
        ) from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            guess = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean '{module_name}:{guess[0]}'?" if guess else ""
            raise ConfigError(f"{field_name}={value!r}: {module_name!r} has no attribute {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field_name}={value!r} names {type(target).__name__}, not a callable")
    return target


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
    ``dtype`` is the dtype of the model parts and of the tensors sent between stages.
    ``scale_grads_in_schedule`` divides gradients by the number of microbatches (mean instead of
    sum). ``loss_fn(output, target)`` runs on the last stage. ``pp_seq_len`` fixes the sequence
    length so stage shapes are static. ``pp_recv_buffer_pool`` reuses receive buffers, keeping
    ``pp_recv_buffer_pool_slack`` spare buffer sets.
    """

    pp_schedule: Optional[str] = "1f1b"
    pp_schedule_csv: Optional[str] = None
    pp_microbatch_size: int = 1
    pp_batch_size: int = 1
    layers_per_stage: Optional[int] = None
    round_virtual_stages_to_pp_multiple: Optional[str] = None
    module_fqns_per_model_part: Optional[list] = None
    patch_inner_model: bool = True
    patch_causal_lm_model: bool = True
    patch_stage_backward_maybe_with_nosync: bool = False
    dtype: Any = None
    scale_grads_in_schedule: bool = False
    loss_fn: Optional[Union[Callable, str]] = None
    pp_seq_len: Optional[int] = None
    pp_recv_buffer_pool: bool = False
    pp_recv_buffer_pool_slack: int = 2

    def __post_init__(self) -> None:
        if self.pp_schedule is None:
            if self.pp_schedule_csv is None:
                raise ConfigError(
                    "pp_schedule=None needs pp_schedule_csv: set one of the two, a schedule name "
                    "such as pp_schedule='1f1b' or a compute-only CSV file as pp_schedule_csv"
                )
        elif not isinstance(self.pp_schedule, str) or not self.pp_schedule.strip():
            raise ConfigError(
                f"pp_schedule={self.pp_schedule!r} must be a schedule name such as '1f1b' (or "
                f"None with pp_schedule_csv); run 'pp-core plugins' to list the installed schedules"
            )
        if isinstance(self.pp_schedule, str) and self.pp_schedule.lower() == "auto":
            self._check_auto()
        if self.pp_schedule_csv is not None and not isinstance(self.pp_schedule_csv, (str, bytes)) \
                and not hasattr(self.pp_schedule_csv, "__fspath__"):
            raise ConfigError(f"pp_schedule_csv={self.pp_schedule_csv!r} must be a path to a CSV file")
        for name in ("pp_microbatch_size", "pp_batch_size"):
            self._positive_int(name)
        if self.pp_batch_size % self.pp_microbatch_size:
            lower = self.pp_batch_size - self.pp_batch_size % self.pp_microbatch_size
            raise ConfigError(
                f"pp_batch_size={self.pp_batch_size} is not divisible by "
                f"pp_microbatch_size={self.pp_microbatch_size}; use pp_batch_size="
                + (f"{lower} or " if lower else "") + f"{lower + self.pp_microbatch_size}, or a "
                f"pp_microbatch_size that divides {self.pp_batch_size}"
            )
        if self.layers_per_stage is not None:
            self._positive_int("layers_per_stage")
        if self.pp_seq_len is not None:
            self._positive_int("pp_seq_len")
        if self.round_virtual_stages_to_pp_multiple not in _ROUNDING:
            raise ConfigError(
                f"round_virtual_stages_to_pp_multiple={self.round_virtual_stages_to_pp_multiple!r}"
                f" must be None, 'up' or 'down'"
            )
        slack = self.pp_recv_buffer_pool_slack
        if not _is_int(slack) or slack < 0:
            raise ConfigError(
                f"pp_recv_buffer_pool_slack={slack!r} must be an int >= 0 (a bool is not "
                f"accepted); use e.g. 2"
            )
        for name in ("patch_inner_model", "patch_causal_lm_model",
                     "patch_stage_backward_maybe_with_nosync", "scale_grads_in_schedule",
                     "pp_recv_buffer_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        self._check_fqns()
        if self.dtype is not None and not resolve_dtype(self.dtype).is_floating_point:
            raise ConfigError(f"dtype={self.dtype!r} is not a floating-point dtype; parameters "
                              f"and activations need one: use 'float32', 'bfloat16' or 'float16'")
        if self.loss_fn is not None:
            if isinstance(self.loss_fn, str) and ":" not in self.loss_fn:
                if "." in self.loss_fn:  # kedro-style guess: a dotted path meant as module:attr
                    module, _, attr = self.loss_fn.rpartition(".")
                    raise ConfigError(
                        f"loss_fn={self.loss_fn!r} is neither a built-in loss nor a 'module:attr' "
                        f"string; did you mean '{module}:{attr}'?"
                    )
                from pp_core.losses import get_loss  # a bare built-in name such as cross_entropy

                get_loss(self.loss_fn)
            else:
                resolve_callable(self.loss_fn, "loss_fn")

    def _check_auto(self) -> None:
        """``pp_schedule="auto"``: the planner picks schedule, stages and split; nothing may fix
        them too (it would be silently overridden)."""
        for name in ("pp_schedule_csv", "module_fqns_per_model_part", "layers_per_stage"):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"pp_schedule='auto' chooses the schedule and the split, but {name} is set "
                    f"too; unset {name}, or name a schedule instead of 'auto'")

    def _positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive int (>= 1)")

    def _check_fqns(self) -> None:
        parts = self.module_fqns_per_model_part
        if parts is None:
            return
        if not isinstance(parts, (list, tuple)) or not parts:
            raise ConfigError(
                f"module_fqns_per_model_part={parts!r} must be a non-empty list of lists of module "
                f"names, e.g. [['embed', 'layers.0'], ['layers.1', 'norm', 'output']]"
            )
        owner: dict[str, int] = {}
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
                if fqn in owner:
                    raise ConfigError(
                        f"module_fqns_per_model_part: {fqn!r} is in part {owner[fqn]} and in part "
                        f"{index}; each module belongs to exactly one part"
                    )
                owner[fqn] = index

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
                guess = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {guess[0]!r}?" if guess else ""
                raise ConfigError(
                    f"unknown PipelineConfig field {key!r}{hint} (valid fields: {', '.join(names)})"
                )
        return cls(**values)
