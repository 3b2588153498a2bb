"""The tensor-parallel plan of the demo GPT (``gpt``, ``uneven_gpt``), Megatron-style.

Per block: the fused ``qkv`` projection column-wise (each tp rank holds whole heads: the q, k and v
rows of its heads, a strided shard of the fused weight), ``proj`` row-wise; the MLP's first
Linear column-wise, its last row-wise; so each block costs two all-reduces forward and two
backward. Embeddings row-wise (vocabulary / positions split), the head ``output`` column-wise
with its logits gathered (``Replicate``) for the loss. With sequence parallelism the norms run
on sequence shards (``SequenceParallel``), the all-reduces become reduce-scatter + all-gather, and
the activations between blocks - and between pipeline stages - are sequence shards.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["gpt_plan", "FusedColwiseParallel"]


def _fused_colwise():
    from torch import nn  # lazy: torch.distributed.tensor (seconds), only when a plan is built
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` for a Linear whose output is ``chunks`` projections side by side
        (``[q; k; v]``): tp rank r holds the r-th shard of each (a ``_StridedShard`` of the
        weight), so its local output is ``[q_r, k_r, v_r]``, whole heads of each."""

        def __init__(self, chunks: int = 3, **kwargs):
            super().__init__(**kwargs)
            self.chunks = chunks

        def _partition_linear_fn(self, name, module, device_mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                shard = distribute_tensor(param, device_mesh,
                                          [_StridedShard(0, split_factor=self.chunks)],
                                          src_data_rank=self.src_data_rank)
                module.register_parameter(pname, nn.Parameter(shard, param.requires_grad))

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            # the output is a strided shard already: hand out the local [q_r, k_r, v_r]
            return outputs.to_local() if use_local_output else outputs

    return FusedColwiseParallel


def __getattr__(name):
    if name == "FusedColwiseParallel":
        return _fused_colwise()
    raise AttributeError(name)


def gpt_plan(model, sequence_parallel: bool) -> Optional[dict]:
    """The plan for a :class:`~pp_core_builtins.models.gpt.GPT` (whole or one part), else None."""
    from pp_core_builtins.models.gpt import GPT  # lazy: torch, off the plugin listing

    if not isinstance(model, GPT):
        return None
    from torch.distributed.tensor import Replicate, Shard  # lazy: torch.distributed.tensor, seconds
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    fused = _fused_colwise()
    between = Shard(1) if sequence_parallel else Replicate()  # layout between the blocks
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # positions are [B, S] (the model expands its own; packed rows bring theirs)
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "layers.*.qkv": fused(3, input_layouts=between),
        "layers.*.proj": RowwiseParallel(output_layouts=between),
        "layers.*.ffn.0": ColwiseParallel(input_layouts=between),
        "layers.*.ffn.2": RowwiseParallel(output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan.update({"layers.*.attention_norm": SequenceParallel(),
                     "layers.*.ffn_norm": SequenceParallel(), "norm": SequenceParallel()})
    return plan
