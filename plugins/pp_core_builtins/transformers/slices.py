"""Sequence slices (``pipeline.pp_seq_chunks``) through an HF decoder's own attention.

HF attention calls ``cache.update(keys, values, layer_idx, ...)`` and attends to what it
returns; during a slice's forward each layer gets a :class:`SliceCache` whose ``update`` returns
the prefix's keys and values from :func:`pp_core.current_seq_slice` (the earlier slices' as
leaves, then this slice's); under the slice's ``routing`` mode the layer's SDPA call is answered
by the prefix attention that saves the per-slice pieces only. The mask
is the query block of the slice against the prefix, causal within a document (position ids
restart where one starts, the rule of transformers' packed masks) and with the 2-D padding mask
of the prefix; positions continue from the slice's offset.
Only full-attention layers under ``sdpa`` take slices (a boolean mask); others are refused.
"""

from __future__ import annotations

import torch

from pp_core import ConfigError

__all__ = ["SliceCache", "slice_mask", "slice_positions", "check_layer_kind"]


class SliceCache:
    """A duck-typed transformers ``Cache`` for one layer of one slice's forward: ``update``
    hands HF the concatenated prefix (its shape logic and ``repeat_kv`` read it) and leaves the
    per-slice pieces pending on the slice (``SeqSlice.pieces``); the layer's SDPA call, under
    ``SeqSlice.routing``, is then answered over those pieces, saving them and not the
    concatenation or its repeat (:mod:`pp_core.runtime.prefix_attention`)."""

    def __init__(self, piece, layer):
        self.piece, self.layer = piece, layer

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.piece.joined(self.piece.pieces(self.layer, key_states, value_states))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def slice_positions(piece, length: int, device) -> torch.Tensor:
    """``[1, length]`` position ids of the slice (they continue from the earlier slices)."""
    start = piece.offset(length)
    return torch.arange(start, start + length, device=device).unsqueeze(0)


def slice_mask(piece, text, position_ids: torch.Tensor, attention_mask) -> torch.Tensor:
    """``[batch, 1, queries, keys]`` bool: the slice's queries against the whole prefix."""
    full = piece.prefix(text, "position_ids", position_ids)
    first = full[..., :1] - 1
    document = (torch.diff(full, prepend=first, dim=-1) != 1).cumsum(-1)
    keys, queries = full.shape[-1], position_ids.shape[-1]
    causal = piece.causal_mask(queries, keys, full.device)
    mask = (document[:, -queries:, None] == document[:, None, :]) & causal
    if attention_mask is not None:
        padding = piece.prefix(text, "attention_mask", attention_mask)
        mask = mask & padding[:, None, :].bool()
    return mask[:, None]


def check_layer_kind(kind: str, text) -> None:
    implementation = getattr(getattr(text, "config", None), "_attn_implementation", None)
    if kind != "full_attention" or implementation != "sdpa":
        raise ConfigError(
            f"pipeline.pp_seq_chunks > 1: {type(text).__name__} layers of attention type "
            f"{kind!r} under attn_implementation={implementation!r} cannot take sequence "
            f"slices (only full attention under 'sdpa'); set pp_seq_chunks: 1 or "
            f"model.args.attn_implementation: sdpa", field="pp_seq_chunks")
