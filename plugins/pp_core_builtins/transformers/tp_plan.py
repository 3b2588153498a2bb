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

Vision-language models (``llava``, ``llava_next``, ``qwen2_vl``): the same plan on the text
module (``model.language_model``), the embedding's output replicated so the image features can
be scattered into it; a CLIP / SigLIP tower's blocks sharded alike (q/k/v and ``fc1``
column-wise, ``out_proj`` and ``fc2`` row-wise, replicated between blocks), so a stage holding
only the tower still divides its work; Qwen2-VL's tower (its fused ``qkv`` reshaped by head
count) stays replicated. Sequence parallelism is refused for them: the images merge into the
whole sequence's embeddings.
"""

from __future__ import annotations

import functools
from typing import Optional

__all__ = ["SUPPORTED", "hf_decoder_plan"]

SUPPORTED = ("llama", "qwen2", "mistral")
_VISION_TEXT = SUPPORTED + ("qwen2_vl_text",)


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


def _text_of(config) -> Optional[tuple[str, bool]]:
    """``(text module, is a VLM)`` of a config this plan covers, else ``None``."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED:
        return "model", False
    from pp_core_builtins.transformers.vision import FAMILIES  # lazy: torch

    text = getattr(getattr(config, "text_config", None), "model_type", None)
    if model_type in FAMILIES and text in _VISION_TEXT:
        return "model.language_model", True
    return None


def hf_decoder_plan(model, sequence_parallel: bool) -> Optional[dict]:
    """The plan for a supported ``...ForCausalLM`` or VLM (whole or one part), else ``None``."""
    found = _text_of(getattr(model, "config", None))
    if found is None:
        return None
    text, vision = found
    if vision and sequence_parallel:
        from pp_core import ConfigError  # lazy: with the plan

        raise ConfigError("distributed.sequence_parallel: a vision-language model scatters its "
                          "image features into the whole sequence's embeddings, so its decoder "
                          "cannot run on sequence shards yet; set sequence_parallel: false")
    from torch.distributed.tensor import Replicate, Shard  # lazy: torch.distributed.tensor, seconds
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    layer = f"{text}.layers.*"
    between = Shard(1) if sequence_parallel else Replicate()  # layout between the blocks
    plan = {
        f"{text}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        f"{layer}.self_attn.q_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.k_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.v_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=between),
        f"{layer}.mlp.gate_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.mlp.up_proj": ColwiseParallel(input_layouts=between),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if vision and model.config.model_type != "qwen2_vl":  # a CLIP / SigLIP tower
        block = "model.vision_tower.encoder.layers.*"
        plan.update({f"{block}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
        plan.update({f"{block}.self_attn.out_proj": RowwiseParallel(),
                     f"{block}.mlp.fc1": ColwiseParallel(), f"{block}.mlp.fc2": RowwiseParallel()})
    if sequence_parallel:
        plan.update({text: _sequence_shards()(),
                     f"{layer}.input_layernorm": SequenceParallel(),
                     f"{layer}.post_attention_layernorm": SequenceParallel(),
                     f"{text}.norm": SequenceParallel()})
    return plan
