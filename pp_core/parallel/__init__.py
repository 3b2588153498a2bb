"""Every parallelism except the pipeline's, composed with torch's engines, applied per block of
this rank's model parts, in place.

The layout first: :class:`pp_core.parallel.dims.ParallelDims` holds every degree and builds every
mesh and group. Then the order that composes: :func:`apply_tensor_parallel` and
:func:`apply_expert_parallel` (right after the split), then
:func:`apply_activation_checkpointing`, then :func:`apply_compile`, then
FSDP2 / HSDP / replication (:func:`apply_data_parallel`). Parameter names (FQNs) never change, so
checkpoints and tied weights still match. The YAML keys ``train.activation_checkpointing`` and
``train.compile`` call these same helpers.

The names load on first use (PEP 562), so ``pp_core.parallel.dims`` - which the YAML spec reads -
imports no torch.
"""

import importlib

__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_data_parallel",
           "apply_expert_parallel", "apply_tensor_parallel", "checkpoint_block", "find_blocks",
           "ParallelDims"]

_HOMES = {"apply_activation_checkpointing": "activation", "checkpoint_block": "activation",
          "find_blocks": "blocks", "apply_compile": "compile",
          "apply_data_parallel": "data_parallel", "apply_expert_parallel": "expert",
          "apply_tensor_parallel": "tensor_parallel", "ParallelDims": "dims"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f"pp_core.parallel.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'pp_core.parallel' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
