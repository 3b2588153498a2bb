"""Stage-friendly forwards for HF decoders (``patch_inner_model``, ``patch_causal_lm_model``).

An HF decoder's own ``forward`` needs every module (it always embeds, always normalises, indexes
``self.layers[:n]``) and returns a ``ModelOutput``. On a pipeline stage only some modules exist,
so the part's text module and root get these forwards instead:

    first stage   forward(input_ids, attention_mask=None, position_ids=None)  # or **dict / *tuple
    later stages  forward(hidden_states, position_ids, attention_mask=None)   # = *previous outputs
    returns       (hidden_states, position_ids[, attention_mask])  while the decoder goes on,
                  the normalised hidden states on the stage holding ``norm``,
                  logits on the stage holding ``lm_head`` (patched root).

Only the 2-D padding mask and the position ids cross stages (integer tensors, no gradient);
every stage rebuilds its 4-D causal / sliding-window masks and its rotary table from them with
transformers' own functions, so each stage sees exactly what the unsplit model would. With
sequence parallelism the hidden states are a tp rank's sequence shard: the masks and the rotary
table are still built for the whole sequence, whose length the position ids give.
Architecture quirks (embedding multipliers, logit soft-capping, per-layer attention types) live in
:class:`DecoderAdapter`, which a third-party splitter can subclass (docs/transformers.md).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from torch import nn

from pp_core import ConfigError, current_seq_slice
from pp_core.errors import DISTRIBUTION
from pp_core_builtins.transformers.slices import (SliceCache, check_layer_kind, slice_mask,
                                                  slice_positions)

__all__ = ["DecoderAdapter", "GemmaAdapter", "MRopeAdapter", "BUILTIN_ADAPTERS",
           "patch_text_module", "patch_causal_lm", "text_stage_forward"]

_MASK_FUNCTIONS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}
_FIRST_STAGE_ARGS = ("input_ids", "attention_mask", "position_ids")


@functools.lru_cache(maxsize=None)
def _mask_function(attention_type: str):
    try:
        from transformers import masking_utils  # lazy: transformers, seconds to import
    except ImportError:
        import transformers  # lazy: transformers, seconds to import

        raise ConfigError(f"pp_core_builtins.transformers needs transformers>=4.53 "
                          f"(masking_utils), found {transformers.__version__}; "
                          f"pip install -U '{DISTRIBUTION}[transformers]'"
                          ) from None

    name = _MASK_FUNCTIONS.get(attention_type)
    function = getattr(masking_utils, name, None) if name else None
    if function is None:
        raise ConfigError(
            f"layer attention type {attention_type!r} has no mask builder in this transformers "
            f"version (known: {', '.join(_MASK_FUNCTIONS)}); override "
            f"DecoderAdapter.attention_mask for this architecture (docs/transformers.md)")
    return function, frozenset(inspect.signature(function).parameters)


class DecoderAdapter:
    """The steps of a stage forward that differ between architectures; subclass to add one.

    The defaults cover Llama-style decoders (Llama, Mistral, Qwen2/3, Gemma, Gemma 2, Granite,
    Phi-3, ...): each method reads the optional config attribute the HF model reads.
    """

    def embed(self, text: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings on the first stage (Granite multiplies them by a constant)."""
        hidden = text.embed_tokens(input_ids)
        multiplier = getattr(text, "embedding_multiplier", None)
        return hidden * multiplier if multiplier is not None else hidden

    def attention_type(self, text: nn.Module, layer: nn.Module, index: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` (…) for layer ``index``."""
        found = getattr(layer, "attention_type", None)
        if isinstance(found, str):
            return found
        config = text.config
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return layer_types[index]
        if getattr(config, "sliding_window", None) is not None and \
                getattr(config, "use_sliding_window", True):
            return "sliding_attention"
        return "full_attention"

    def attention_mask(self, text, attention_type, hidden, attention_mask, position_ids):
        """The mask the layers of ``attention_type`` get, built by transformers' own function."""
        function, accepted = _mask_function(attention_type)
        embeds = "inputs_embeds" if "inputs_embeds" in accepted else "input_embeds"  # 4.x name
        kwargs = {"config": text.config, embeds: hidden,
                  "attention_mask": attention_mask, "position_ids": position_ids}
        for name in ("cache", "past_key_values"):  # 5.25 lists both: the old name deprecated
            if name in accepted:
                kwargs[name] = None
                break
        if "cache_position" in accepted:  # transformers 4.x
            kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
        return function(**kwargs)

    def position_embeddings(self, text, hidden, position_ids):
        """``(cos, sin)`` from the text module's rotary embedding (present on every stage)."""
        rotary = getattr(text, "rotary_emb", None)
        return rotary(hidden, position_ids) if rotary is not None else None

    def call_layer(self, layer, hidden, mask, position_embeddings, position_ids) -> torch.Tensor:
        out = layer(hidden, attention_mask=mask, position_ids=position_ids,
                    position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns a tuple

    def logits(self, root: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` plus the post-processing the HF wrapper applies (scaling, soft-capping)."""
        logits = head(hidden)
        config = getattr(root, "config", None)
        scaling = getattr(config, "logits_scaling", None)  # Granite
        if scaling is not None:
            logits = logits / scaling
        scale = getattr(root, "logit_scale", None)  # Cohere
        if isinstance(scale, (int, float)):
            logits = logits * scale
        cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class GemmaAdapter(DecoderAdapter):
    """Gemma scales embeddings by sqrt(hidden_size): inside the embedding module since
    transformers 5 (``embed_scale``), in the decoder's forward before."""

    def embed(self, text: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = text.embed_tokens(input_ids)
        if hasattr(text.embed_tokens, "embed_scale"):
            return hidden
        return hidden * torch.tensor(text.config.hidden_size ** 0.5, dtype=hidden.dtype)


class MRopeAdapter(DecoderAdapter):
    """Qwen2-VL's decoder: rotary positions ``[3, batch, seq]`` (temporal, height, width), or
    ``[4, batch, seq]`` with the text positions first; the masks read only those text
    positions (none for 3 rows), as ``Qwen2VLTextModel`` does."""

    @staticmethod
    def _split(position_ids):
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:
            return position_ids[0], position_ids[1:]
        return None, position_ids

    def attention_mask(self, text, attention_type, hidden, attention_mask, position_ids):
        return super().attention_mask(text, attention_type, hidden, attention_mask,
                                      self._split(position_ids)[0])

    def position_embeddings(self, text, hidden, position_ids):
        return super().position_embeddings(text, hidden, self._split(position_ids)[1])

    def call_layer(self, layer, hidden, mask, position_embeddings, position_ids):
        return super().call_layer(layer, hidden, mask, position_embeddings,
                                  self._split(position_ids)[0])


BUILTIN_ADAPTERS = {"gemma": GemmaAdapter(), "gemma2": GemmaAdapter(), "qwen2_vl": MRopeAdapter()}
"""Adapters ``hf_decoder`` uses by ``model_type``; every other type gets the default one."""


def _first_stage_inputs(args, kwargs):
    values = dict(zip(_FIRST_STAGE_ARGS, args))
    if len(args) > len(_FIRST_STAGE_ARGS):
        raise TypeError(f"the first stage takes at most (input_ids, attention_mask, position_ids) "
                        f"positionally, got {len(args)} values")
    for name, value in kwargs.items():
        if name not in _FIRST_STAGE_ARGS + ("inputs_embeds",):
            raise TypeError(
                f"the first pipeline stage got an unexpected input {name!r}; a microbatch dict "
                f"may hold input_ids (or inputs_embeds), attention_mask and position_ids; pass "
                f"labels as the step's target instead")
        if name in values:
            raise TypeError(f"the first stage got {name!r} twice (positionally and by name)")
        values[name] = value
    return values


def _layers(text: nn.Module):
    layers = text.layers
    items = layers.items() if isinstance(layers, nn.ModuleDict) else layers._modules.items()
    return [(int(key), layer) for key, layer in items if layer is not None]


def _sequence_shard(embeds: torch.Tensor, mesh) -> torch.Tensor:
    """This tp rank's sequence shard of ``inputs_embeds`` (all tp ranks are given the same)."""
    size, length = mesh.size(), embeds.shape[1]
    if length % size:
        raise ValueError(f"with sequence parallelism the sequence length must divide by tp_size: "
                         f"got inputs_embeds of {length} tokens at tp_size {size}")
    return embeds.narrow(1, mesh.get_local_rank() * (length // size), length // size)


def _whole_sequence(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``hidden``, or where it is this tp rank's sequence shard ``[b, s/tp, d]`` (sequence
    parallelism) an empty ``[b, s, 0]`` stand-in of its dtype and device: the masks and the rotary
    table read only those, and must cover the whole sequence, whose length the (never sharded)
    position ids give. Attention all-gathers the shards before q/k/v, so it runs on all of it."""
    length = position_ids.shape[-1]
    if hidden.shape[1] == length:
        return hidden
    mesh = getattr(self, "pp_sequence_shards", None)
    if mesh is not None and length % mesh.size():
        raise ValueError(f"with sequence parallelism the sequence length must divide by tp_size "
                         f"(a stage receives sequence shards of equal length): got {length} "
                         f"tokens at tp_size {mesh.size()}; pad the batch to a multiple")
    return torch.empty((hidden.shape[0], length, 0), dtype=hidden.dtype, device=hidden.device)


def text_stage_forward(self, *args, adapter: DecoderAdapter, **kwargs):
    """The patched text-module forward (bound by :func:`patch_text_module`)."""
    if self.embed_tokens is not None:
        inputs = _first_stage_inputs(args, kwargs)
        input_ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
        if (input_ids is None) == (embeds is None):
            raise TypeError("the first stage needs exactly one of input_ids and inputs_embeds")
        hidden = adapter.embed(self, input_ids) if embeds is None else embeds
        attention_mask, position_ids = inputs.get("attention_mask"), inputs.get("position_ids")
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be the 2-D padding mask [batch, seq], got "
                                 f"shape {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(torch.long)
        if position_ids is None:  # the whole sequence's, also when ``hidden`` is a shard
            length = (input_ids if embeds is None else embeds).shape[1]
            position_ids = torch.arange(length, device=hidden.device).unsqueeze(0) \
                if current_seq_slice() is None else \
                slice_positions(current_seq_slice(), length, hidden.device)
        if embeds is not None and getattr(self, "pp_sequence_shards", None) is not None:
            hidden = _sequence_shard(embeds, self.pp_sequence_shards)
    else:
        if kwargs or not 2 <= len(args) <= 3:
            raise TypeError(
                f"a later stage takes (hidden_states, position_ids[, attention_mask]) from the "
                f"previous stage, got {len(args)} positional and {sorted(kwargs)} keyword inputs")
        hidden, position_ids = args[0], args[1]
        attention_mask = args[2] if len(args) == 3 else None
    masks: dict[str, object] = {}
    whole = _whole_sequence(self, hidden, position_ids)
    position_embeddings = adapter.position_embeddings(self, whole, position_ids)
    piece = current_seq_slice()
    for index, layer in _layers(self):
        kind = adapter.attention_type(self, layer, index)
        if piece is not None:  # a sequence slice (pp_core_builtins.transformers.slices)
            check_layer_kind(kind, self)
            if kind not in masks:
                masks[kind] = slice_mask(piece, self, position_ids, attention_mask)
            with piece.routing():  # the layer's SDPA over the cache's pieces (slices.py)
                out = layer(hidden, attention_mask=masks[kind], position_ids=position_ids,
                            position_embeddings=position_embeddings,
                            cache=SliceCache(piece, layer))
            hidden = out[0] if isinstance(out, tuple) else out
            continue
        if kind not in masks:
            masks[kind] = adapter.attention_mask(self, kind, whole, attention_mask, position_ids)
        hidden = adapter.call_layer(layer, hidden, masks[kind], position_embeddings, position_ids)
    if self.norm is not None:
        return self.norm(hidden)
    return (hidden, position_ids) if attention_mask is None else (hidden, position_ids,
                                                                   attention_mask)


def held_module(root: nn.Module, fqn: str):
    """The module at ``fqn`` on this part, or ``None`` when another stage holds it."""
    module = root
    for piece in fqn.split(".") if fqn else []:
        module = module._modules.get(piece)
        if module is None:
            return None
    return module


def _hidden(output):
    """The hidden states of a text module output: a tensor, a tuple, or a ``ModelOutput``."""
    if isinstance(output, torch.Tensor) or isinstance(output, tuple) and \
            not hasattr(output, "last_hidden_state"):
        return output
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def causal_lm_stage_forward(self, *args, text_name: str, head_name: str | None,
                            adapter: DecoderAdapter, **kwargs):
    """The patched root forward (bound by :func:`patch_causal_lm`)."""
    text = held_module(self, text_name)
    holds_text = text is not None and (text.embed_tokens is not None or
                                       next(text.parameters(), None) is not None)
    output = _hidden(text(*args, **kwargs)) if holds_text else (args[0] if len(args) == 1
                                                                  else args)
    head = held_module(self, head_name) if head_name else None
    if head is None:
        return output
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"the stage holding {head_name!r} must also hold the decoder's final norm (or follow "
            f"the stage that does); got {type(output).__name__} from the decoder")
    return adapter.logits(self, head, output)


def patch_text_module(text: nn.Module, adapter: DecoderAdapter) -> None:
    """Give this part's text module (a per-part copy) the stage forward."""
    text.forward = types.MethodType(functools.partial(text_stage_forward, adapter=adapter), text)


def patch_causal_lm(root: nn.Module, text_name: str, head_name: str | None,
                    adapter: DecoderAdapter) -> None:
    """Give this part's root (a per-part copy) a forward returning hidden states or logits."""
    forward = functools.partial(causal_lm_stage_forward, text_name=text_name, head_name=head_name,
                                adapter=adapter)
    root.forward = types.MethodType(forward, root)
    root.pp_seq_slices = True  # its text module takes slices (full attention under sdpa)
