"""Sequence slices (``pipeline.pp_seq_chunks``) through an HF decoder's own attention.

HF attention calls ``cache.update(keys, values, layer_idx, ...)`` and attends to what it
returns; during a slice's forward each layer gets a :class:`SliceCache` whose ``update`` returns
the prefix's keys and values from :func:`pp_core.current_seq_slice` (the earlier slices' as
leaves, then this slice's), and which, entered as a torch function mode around the layer, answers
the layer's SDPA call with the prefix attention that saves the per-slice pieces only. The mask
is the query block of the slice against the prefix, causal within a document (position ids
restart where one starts, the rule of transformers' packed masks) and with the 2-D padding mask
of the prefix; positions continue from the slice's offset.
Only full-attention layers under ``sdpa`` take slices (a boolean mask); others are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as functional
from torch.overrides import TorchFunctionMode

from pp_core import ConfigError

__all__ = ["SliceCache", "slice_mask", "slice_positions", "check_layer_kind"]


class SliceCache(TorchFunctionMode):
    """A duck-typed transformers ``Cache`` for one layer of one slice's forward, and the torch
    function mode that routes that layer's ``scaled_dot_product_attention`` to the prefix
    attention (enter it around the layer's call).

    ``update`` hands HF the concatenated prefix (its shape logic and ``repeat_kv`` read it) and
    keeps the per-slice pieces; the layer's SDPA call is then answered by
    ``SeqSlice.attend`` over those pieces, which saves them, not the concatenation or its
    repeat (:mod:`pp_core.runtime.prefix_attention`). The concatenation HF made is dropped
    unused. A call this mode cannot answer exactly (dropout on, or no pieces pending) runs as HF
    made it."""

    def __init__(self, piece, layer):
        super().__init__()
        self.piece, self.layer = piece, layer
        self.pending = None  # the pieces of the last update, until the layer's SDPA call

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.pending = self.piece.pieces(self.layer, key_states, value_states)
        return tuple(torch.cat([p[i] for p in self.pending], dim=2) if len(self.pending) > 1
                     else self.pending[0][i] for i in range(2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is functional.scaled_dot_product_attention and self.pending is not None \
                and len(self.pending) > 1:
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if not dropout and (mask is None or mask.dtype == torch.bool):
                pieces, self.pending = self.pending, None
                return self.piece.attend(pieces, args[0], mask, kwargs.get("scale"))
        return func(*args, **kwargs)


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
