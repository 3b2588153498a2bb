"""Every parallelism except the pipeline's, composed with torch's engines, applied per block of
this rank's model parts, in place.

The layout first: :class:`pp_core.parallel.dims.ParallelDims` holds every degree and builds every
mesh and group (:class:`~pp_core.parallel.dims.Meshes`). Then :func:`parallelize` (in
:mod:`pp_core.parallel.compose`) applies them in the one order that composes:
:func:`apply_tensor_parallel` and :func:`apply_expert_parallel` (right after the split), then
:func:`apply_activation_checkpointing`, then :func:`apply_compile`, then FSDP2 / HSDP /
replication (:func:`apply_data_parallel`); ``Pipeline.step`` ends with its :func:`after_step`.
Parameter names (FQNs) never change, so checkpoints and tied weights still match. ``pp-core
run`` composes through the same function.

The names load on first use (PEP 562), so ``pp_core.parallel.dims`` - which the YAML spec reads -
imports no torch.
"""

from pp_core.lazy import lazy_face

__all__ = ["parallelize", "ParallelSettings", "after_step", "apply_activation_checkpointing",
           "apply_compile", "apply_data_parallel", "apply_expert_parallel", "apply_tensor_parallel",
           "checkpoint_block", "find_blocks", "ParallelDims", "Meshes"]

_HOMES = {"apply_activation_checkpointing": "activation", "checkpoint_block": "activation",
          "find_blocks": "blocks", "apply_compile": "compile",
          "apply_data_parallel": "data_parallel", "apply_expert_parallel": "expert",
          "apply_tensor_parallel": "tensor_parallel", "ParallelDims": "dims", "Meshes": "dims",
          "parallelize": "compose", "ParallelSettings": "compose", "after_step": "compose"}

__getattr__, __dir__ = lazy_face(__name__, {name: f".{home}" for name, home in _HOMES.items()})
