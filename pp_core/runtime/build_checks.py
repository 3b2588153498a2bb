"""What ``build_pipeline`` refuses before any collective: a model already wrapped by a
data-parallel engine, a model without values (meta device), a device this machine lacks.

``fully_shard`` (FSDP2), ``replicate`` and ``DistributedDataParallel`` install hooks that run
collectives over their own mesh whenever the module runs or its parameters are read; splitting
such a model sends each rank into different collectives, which deadlock until the process-group
timeout (30 minutes by default) with a misleading transport error. The fix is the order torchtitan
uses: build the pipeline from the plain model, then wrap ``pipe.model_parts`` (and blocks inside
them) in place - :func:`pp_core.parallel.apply_data_parallel` does it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from pp_core._torch_compat import composable_engines
from pp_core.errors import ConfigError

__all__ = ["check_not_wrapped", "wrapped_modules", "check_materialised", "check_device"]


def _engines(module: nn.Module) -> list[str]:
    found = []
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    if fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ())):
        found.append("fully_shard (FSDP2)")
    if fsdp is not None and isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
        found.append("FullyShardedDataParallel")
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is not None and isinstance(module, ddp.DistributedDataParallel):
        found.append("DistributedDataParallel")
    for name in composable_engines(module):
        if name in ("replicate", "fully_shard") and not found:
            found.append(name)
    return found


def wrapped_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``(fqn, engine)`` for each module a data-parallel engine manages."""
    return [(name or "<the model>", engine) for name, module in model.named_modules()
            for engine in _engines(module)]


def check_not_wrapped(model: nn.Module) -> None:
    """Raise a ConfigError naming the wrapped modules, with the order that works."""
    found = wrapped_modules(model)
    if not found:
        return
    shown = ", ".join(f"{fqn!r} ({engine})" for fqn, engine in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    raise ConfigError(
        f"the model passed to build_pipeline is already wrapped for data parallelism: {shown}"
        f"{more}; its hooks would run collectives while the model is split, and the ranks would "
        f"hang. Build the pipeline from the plain model, then wrap the parts afterwards: "
        f"pipe = build_pipeline(model, config); fully_shard each of pipe.model_parts (or "
        f"pp_core.parallel.apply_data_parallel(pipe.model_parts, dp_mesh))")


def check_materialised(model: nn.Module,
                       what: str = "the model passed to build_pipeline") -> None:
    """A model on the meta device has no values to train: refuse it, naming a tensor."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_meta:
            raise ConfigError(
                f"{what} is on the meta device (no values; e.g. "
                f"{name!r}); build it on a real device, or call model.to_empty(device=...) and "
                f"initialise it first (pp_core.plan_pipeline plans on meta without building)")


def check_device(device) -> None:
    """``device`` names a device this process can use (``"tpu:7"``, ``"cuda:3"`` on a machine
    with one GPU, ``"cuda"`` without CUDA are refused with the devices it has)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device={device!r} is not a torch device ({str(exc)[:160]}); use "
                          f"'cpu', 'cuda' or 'cuda:N'") from None
    if parsed.type in ("cpu", "meta"):
        return
    module = getattr(torch, parsed.type, None)
    available = getattr(module, "is_available", None)
    if not callable(available) or not available():
        raise ConfigError(f"device={device!r}: this machine has no {parsed.type} device that "
                          f"torch can use; use 'cpu'" + (" or 'cuda'" if torch.cuda.is_available()
                                                         else ""))
    count = getattr(module, "device_count", lambda: None)()
    if parsed.index is not None and count is not None and parsed.index >= count:
        raise ConfigError(f"device={device!r}: this machine has {count} {parsed.type} "
                          f"device(s), numbered 0..{count - 1}")
