"""Torch's data parallelism on this rank's model parts: FSDP2 ``fully_shard``, HSDP, replication.

``apply_data_parallel(pipe_or_parts, mesh, shard=True, reshard_after_forward=False,
mixed_precision=None)`` wraps each block (:func:`~pp_core.parallel.find_blocks`: the entries of
a ``layers`` container, HF decoder layers, the children of an ``nn.Sequential``) and then each
part with ``fully_shard``, in place, as torchtitan does. ``Pipeline.step`` finds the wrapped
parts itself and reduces their gradients once per stage and step
(:mod:`pp_core.runtime.dp_sync`). One engine for every layout:

* ``shard=True`` on a 1-D mesh: FSDP2 (ZeRO-3: parameters, gradients and optimizer state
  sharded over the mesh);
* a 2-D mesh ``("dp_replicate", "dp_shard")``: HSDP (sharded inside ``dp_shard``, replicated
  across ``dp_replicate``);
* ``shard=False``: pure replication (DDP semantics: full copies, one all-reduce per unit and
  step) with torch's FSDP-based ``replicate`` - the same driver, split backward included.

``mesh`` is the data-parallel sub-mesh (e.g. ``mesh["dp_shard"]`` or
``mesh["dp_replicate", "dp_shard"]`` of the ``("pp", "dp_replicate", "dp_shard")`` mesh).
Apply it after activation checkpointing and compile. Parameter names (FQNs) do not change.
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import torch

from pp_core._torch_compat import fsdp_replicate
from pp_core.config import resolve_dtype
from pp_core.errors import ConfigError
from pp_core.parallel.blocks import find_blocks

__all__ = ["apply_data_parallel", "mixed_precision_policy"]


MIXED_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What FSDP2's mixed precision computes and reduces in (float64 and float8 are not)."""


def mixed_precision_policy(options: Optional[dict]):
    """FSDP2's MixedPrecisionPolicy from ``{param_dtype, reduce_dtype}`` (names like
    ``bfloat16``); ``None`` for none."""
    if not options:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # lazy: fsdp, only with mixed precision

    dtypes = {}
    for key in ("param_dtype", "reduce_dtype"):
        name = options.get(key)
        if name is None:
            continue
        try:  # the spellings model.dtype and pipeline.dtype take (bf16, torch.bfloat16, ...)
            dtype = resolve_dtype(name)
        except ConfigError:
            dtype = None
        if not isinstance(dtype, torch.dtype) or dtype not in MIXED_PRECISION_DTYPES:
            raise ConfigError(f"distributed.mixed_precision.{key}: {name!r} is not a floating "
                              f"point dtype; use float32, bfloat16 or float16")
        dtypes[key] = dtype
    return MixedPrecisionPolicy(**dtypes)


def apply_data_parallel(pipe_or_parts, mesh, shard: bool = True,
                        reshard_after_forward: bool = False, mixed_precision=None,
                        ignored_params=None) -> int:
    """Wrap every block, then every part, in place; returns the FSDP units that hold parameters
    (each reduces its gradients once per step).

    :param mixed_precision: a ``MixedPrecisionPolicy`` or ``{param_dtype, reduce_dtype}``.
    :param ignored_params: parameters the engine leaves alone (neither sharded nor reduced):
        expert-parallel shards, which :func:`pp_core.parallel.expert.sync_expert_gradients`
        averages over their own group.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: fsdp, only with dp

    parts = getattr(pipe_or_parts, "model_parts", pipe_or_parts)
    wrap = fully_shard
    if not shard:
        if mesh.ndim != 1:
            raise ConfigError("apply_data_parallel(shard=False) replicates over a 1-D mesh; for "
                              "replicas of sharded groups pass the 2-D (dp_replicate, dp_shard) "
                              "mesh with shard=True (HSDP)")
        wrap = fsdp_replicate()
    if not isinstance(mixed_precision, MixedPrecisionPolicy):
        mixed_precision = mixed_precision_policy(mixed_precision)
    options = {"mesh": mesh}
    if shard:  # replicas keep their parameters whole
        options["reshard_after_forward"] = reshard_after_forward
    if mixed_precision is not None:
        options["mp_policy"] = mixed_precision
    if ignored_params:
        options["ignored_params"] = set(ignored_params)
    units = 0
    for part in parts:
        try:
            blocks = find_blocks(part)
        except ConfigError:
            blocks = []  # a part without blocks is sharded as one unit
        in_blocks = {id(p) for _, block in blocks for p in block.parameters()}
        units += any(id(p) not in in_blocks for p in part.parameters())  # before fully_shard
        for _, block in blocks:                                           # replaces them
            units += any(True for _ in block.parameters())
            wrap(block, **options)
        wrap(part, **options)
        _quiet_stage_view_warning(part)
    return units


def _quiet_stage_view_warning(part) -> None:
    """Silence FSDP2's "returned a view tensor" warning for a wrapped stage part, and only there.

    torch (2.13 on) warns when a wrapped module returns a view, because an in-place op on it by
    the caller would skip the pre-backward all-gather. A part's caller is pp-core's runtime, which
    never writes into a stage's output (it sends it or hands it to the loss), and tensor
    parallelism's ``to_local()`` outputs are views - so every rank would print a warning that
    does not apply. Blocks keep the warning: the model's own code consumes their outputs.
    """
    name = re.escape(type(part).__name__)  # FSDP<Class> once wrapped
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({name}\) returned a view",
                            category=UserWarning)
