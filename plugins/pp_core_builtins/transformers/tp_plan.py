"""Tensor-parallel plans of the Hugging Face decoders pp-core supports (Llama, Qwen2, Mistral).

Megatron's layout, as torchtitan writes it for Llama: ``q_proj``, ``k_proj``, ``v_proj`` and the
MLP's ``gate_proj`` / ``up_proj`` column-wise (each tp rank holds whole heads, query and key/value
alike, so ``num_attention_heads`` and ``num_key_value_heads`` must divide by tp), ``o_proj`` and
``down_proj`` row-wise, the input embedding row-wise (vocabulary split) and ``lm_head``
column-wise with its logits gathered for the loss. Transformers' attention reshapes with ``-1``
heads, so it runs on the local heads unchanged. A tied ``embed_tokens`` / ``lm_head`` pair is
sharded alike (vocabulary rows) on both stages, so the tied-gradient sum
(:mod:`~pp_core_builtins.transformers.tied`) pairs shard with shard.

With sequence parallelism (the demo GPT's layout): ``input_layernorm``,
``post_attention_layernorm`` and ``model.norm`` run on sequence shards (``SequenceParallel``);
q/k/v and gate/up all-gather their input from ``Shard(1)``, o_proj / down_proj and the embedding
reduce-scatter to ``Shard(1)``, ``lm_head`` gathers its input and its logits. Between blocks and
stages the hidden states are local sequence shards ``[b, s/tp, d]``; the position ids and the
padding mask are never sharded, so every stage builds its masks and rotary table for the whole
sequence (:func:`~pp_core_builtins.transformers.forward.text_stage_forward`), and attention runs
on the gathered sequence with them. The text module is marked (``SequenceShards``) so that
``inputs_embeds`` given to the first stage are cut into the rank's shard too. The sequence
length must divide by tp.
"""

from __future__ import annotations

import functools
from typing import Optional

__all__ = ["SUPPORTED", "hf_decoder_plan"]

SUPPORTED = ("llama", "qwen2", "mistral")


@functools.lru_cache(maxsize=None)  # one class, so isinstance holds
def _sequence_shards():
    from torch.distributed.tensor.parallel import ParallelStyle  # lazy: torch.distributed.tensor

    class SequenceShards(ParallelStyle):
        """Marks a text module whose hidden states are sequence shards: its stage forward
        (:mod:`~pp_core_builtins.transformers.forward`) then cuts ``inputs_embeds`` given to
        the first stage into this tp rank's shard, as the sharded embedding does for
        ``input_ids``, and checks that the sequence length divides by tp."""

        def _apply(self, module, device_mesh):
            module.pp_sequence_shards = device_mesh
            return module

    return SequenceShards


def __getattr__(name):
    if name == "SequenceShards":
        return _sequence_shards()
    raise AttributeError(name)


def hf_decoder_plan(model, sequence_parallel: bool) -> Optional[dict]:
    """The plan for a supported ``...ForCausalLM`` (whole or one part), else ``None``."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED:
        return None
    from torch.distributed.tensor import Replicate, Shard  # lazy: torch.distributed.tensor, seconds
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    layer = "model.layers.*"
    between = Shard(1) if sequence_parallel else Replicate()  # layout between the blocks
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        f"{layer}.self_attn.q_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.k_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.v_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=between),
        f"{layer}.mlp.gate_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.mlp.up_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan.update({"model": _sequence_shards()(),
                     f"{layer}.input_layernorm": SequenceParallel(),
                     f"{layer}.post_attention_layernorm": SequenceParallel(),
                     "model.norm": SequenceParallel()})
    return plan
