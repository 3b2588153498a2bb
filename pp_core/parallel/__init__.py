"""Composition with torch's engines, applied per block of this rank's model parts, in place.

Order that composes: :func:`apply_tensor_parallel` (right after the split), then
:func:`apply_activation_checkpointing`, then :func:`apply_compile`, then
FSDP2 / HSDP / replication (:func:`apply_data_parallel`). Parameter names (FQNs) never change, so checkpoints and tied weights still match.
The YAML keys ``train.activation_checkpointing`` and ``train.compile`` call these same helpers.
"""

from pp_core.parallel.activation import apply_activation_checkpointing, checkpoint_block
from pp_core.parallel.blocks import find_blocks
from pp_core.parallel.compile import apply_compile
from pp_core.parallel.data_parallel import apply_data_parallel
from pp_core.parallel.expert import apply_expert_parallel
from pp_core.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["apply_activation_checkpointing", "apply_compile", "apply_data_parallel",
           "apply_expert_parallel", "apply_tensor_parallel", "checkpoint_block", "find_blocks"]
