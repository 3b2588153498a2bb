"""Attention of one sequence slice over its prefix, saving the per-slice keys and values only.

A slice ``j`` attends to the keys and values of slices ``0..j``. Concatenating them and calling
``scaled_dot_product_attention`` makes autograd save the concatenation: a new ``(j + 1)``-slice
tensor per slice and layer, ``O(K^2)`` slices' worth over a microbatch, on top of the per-slice
pieces every earlier slice keeps anyway (its own attention saved them, and later slices read
them as leaves). :class:`PrefixAttention` saves the query and those pieces instead (the same
storages: nothing new is held) and, in the backward, concatenates them again and recomputes the
attention forward before its backward - one attention forward per slice and layer traded for the
``O(K^2)`` copy. The values are those of the plain path bit for bit (the recompute is the same
computation), so K changes memory and time, never the gradients.

A boolean ``mask`` given (a packed row's document mask, one per slice shared by its layers) is
saved as is; without one the causal mask of the query block against the prefix is built in the
forward and again in the backward, never saved. Grouped-query attention (fewer key/value heads
than query heads) repeats the keys and values inside, so the repeat is not saved either. Under
``torch.compile`` it runs eagerly (``SeqSlice.attention`` is ``torch.compiler.disable``d: dynamo
cannot trace a backward that calls ``torch.autograd.grad``); the rest of the block is compiled.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as functional

__all__ = ["prefix_attention", "causal_block_mask"]


def causal_block_mask(queries: int, keys: int, device) -> torch.Tensor:
    """``[queries, keys]`` bool: query ``i`` (at ``keys - queries + i``) sees keys up to it."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    return torch.arange(keys, device=device)[None, :] <= rows


def _attend(q, keys: Sequence, values: Sequence, mask, scale):
    k, v = torch.cat(list(keys), dim=2), torch.cat(list(values), dim=2)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: every key/value head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if mask is None:
        mask = causal_block_mask(q.shape[2], k.shape[2], q.device)
    return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class PrefixAttention(torch.autograd.Function):
    """``softmax(q K^T) V`` over ``K = cat(keys)``, ``V = cat(values)``; saves ``q``, the pieces
    and a given mask, and recomputes the rest in the backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, mask, scale, count, *pieces):
        keys, values = pieces[:count], pieces[count:]
        ctx.count, ctx.scale, ctx.has_mask = count, scale, mask is not None
        ctx.save_for_backward(q, *pieces, *([mask] if mask is not None else []))
        return _attend(q, keys, values, mask, scale)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        mask = saved[-1] if ctx.has_mask else None
        tensors = saved[:-1] if ctx.has_mask else saved
        needs = (ctx.needs_input_grad[0],) + tuple(ctx.needs_input_grad[4:])
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
            q, pieces = inputs[0], inputs[1:]
            out = _attend(q, pieces[:ctx.count], pieces[ctx.count:], mask, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        grads = [next(found) if t.requires_grad else None for t in inputs]
        return (grads[0], None, None, None, *grads[1:])


def prefix_attention(q: torch.Tensor, keys: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None) -> torch.Tensor:
    """``q`` ``[batch, heads, queries, head_dim]`` attending to the concatenation of ``keys``
    and ``values`` (each ``[batch, kv_heads, length_i, head_dim]``, in sequence order) under
    ``mask`` (bool, broadcastable to ``[batch, heads, queries, keys]``), or causally with the
    queries last in the prefix when ``mask`` is ``None``."""
    if len(keys) != len(values):
        raise ValueError(f"prefix_attention: {len(keys)} key pieces for {len(values)} value "
                         f"pieces; give one of each per slice")
    return PrefixAttention.apply(q, mask, scale, len(keys), *keys, *values)
