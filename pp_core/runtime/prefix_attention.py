"""Attention of one sequence slice over its prefix, saving the per-slice keys and values only.

A slice ``j`` attends to the keys and values of slices ``0..j``. Concatenating them and calling
``scaled_dot_product_attention`` makes autograd save the concatenation: a new ``(j + 1)``-slice
tensor per slice and layer, ``O(K^2)`` slices' worth over a microbatch, on top of the per-slice
pieces every earlier slice keeps anyway (its own attention saved them, and later slices read
them as leaves). :class:`PrefixAttention` saves the query and those pieces instead (the same
storages: nothing new is held) and, in the backward, concatenates them again and recomputes the
attention forward before its backward - one attention forward per slice and layer traded for the
``O(K^2)`` copy. On CPU even that is spared: the function calls SDPA's flash kernel and its
backward directly (the ops SDPA itself dispatches to), saving the output and log-sum-exp as SDPA
does, and the backward only concatenates the pieces again. Either way the values are those of
the plain path (the same computation), so K changes memory and time, never the gradients.

A boolean ``mask`` given (a packed row's document mask, one per slice shared by its layers) is
saved as is; without one the causal mask of the query block against the prefix is built in the
forward and again in the backward, never saved. Grouped-query attention (fewer key/value heads
than query heads) repeats the keys and values inside, so the repeat is not saved either. Inside
blocks compiled by ``apply_compile`` it runs eagerly (``SeqSlice.attention`` is registered with
``pp_core.parallel.compile.run_eagerly_when_compiled``); the rest of the block is compiled.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as functional

from pp_core._torch_compat import CPU_FLASH_ATTENTION

__all__ = ["prefix_attention", "causal_block_mask"]


def causal_block_mask(queries: int, keys: int, device) -> torch.Tensor:
    """``[queries, keys]`` bool: query ``i`` (at ``keys - queries + i``) sees keys up to it."""
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    return torch.arange(keys, device=device)[None, :] <= rows


def _attend(q, keys: Sequence, values: Sequence, mask, scale):
    k, v = _whole(q, keys), _whole(q, values)
    if mask is None:
        mask = causal_block_mask(q.shape[2], k.shape[2], q.device)
    return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _whole(q, pieces: Sequence) -> torch.Tensor:
    """The pieces concatenated along the sequence, repeated to ``q``'s heads (grouped-query
    attention: every key/value head serves a group of query heads)."""
    whole = torch.cat(list(pieces), dim=2)
    if whole.shape[1] != q.shape[1]:
        whole = whole.repeat_interleave(q.shape[1] // whole.shape[1], dim=1)
    return whole


def _grouped(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_whole`'s repeat: summed over each key/value head's group."""
    if grad.shape[1] == heads:
        return grad
    return grad.unflatten(1, (heads, grad.shape[1] // heads)).sum(2)


_CPU_FORWARD, _CPU_BACKWARD = CPU_FLASH_ATTENTION or (None, None)


def _additive(q, keys: int, mask) -> torch.Tensor:
    """The boolean mask (or the causal block) as the additive float mask SDPA's CPU kernel
    takes: ``0`` where attended, ``-inf`` where not (what SDPA makes of a boolean mask)."""
    if mask is None:
        mask = causal_block_mask(q.shape[2], keys, q.device)
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
        mask.logical_not(), float("-inf"))


def _on_cpu_kernel(q) -> bool:
    """Whether SDPA's CPU flash kernel can run this attention directly (forward and backward
    without a recompute): a CPU float tensor and the kernel's ops present."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16,
                                                   torch.float16) and \
        _CPU_FORWARD is not None and _CPU_BACKWARD is not None


class PrefixAttention(torch.autograd.Function):
    """``softmax(q K^T) V`` over ``K = cat(keys)``, ``V = cat(values)``; saves ``q``, the pieces
    and a given mask (module docstring). On CPU it calls SDPA's flash kernel and its backward
    itself, saving the output and log-sum-exp as SDPA would, so nothing is recomputed but the
    concatenation; elsewhere the backward recomputes the attention forward."""

    @staticmethod
    def forward(ctx, q, mask, scale, count, *pieces):
        keys, values = pieces[:count], pieces[count:]
        ctx.count, ctx.scale, ctx.has_mask = count, scale, mask is not None
        ctx.kernel = _on_cpu_kernel(q)
        extra = [mask] if mask is not None else []
        if not ctx.kernel:
            ctx.save_for_backward(q, *pieces, *extra)
            return _attend(q, keys, values, mask, scale)
        k, v = _whole(q, keys), _whole(q, values)
        out, lse = _CPU_FORWARD(q, k, v, 0.0, False, attn_mask=_additive(q, k.shape[2], mask),
                                scale=scale)
        ctx.save_for_backward(q, *pieces, *extra, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        out, lse = (saved.pop(-2), saved.pop(-1)) if ctx.kernel else (None, None)
        mask = saved.pop() if ctx.has_mask else None
        q, pieces = saved[0], saved[1:]
        if ctx.kernel:
            keys, values = pieces[:ctx.count], pieces[ctx.count:]
            k, v = _whole(q, keys), _whole(q, values)
            grad_q, grad_k, grad_v = _CPU_BACKWARD(
                grad_out.contiguous(), q, k, v, out, lse, 0.0, False,
                attn_mask=_additive(q, k.shape[2], mask), scale=ctx.scale)
            lengths = [p.shape[2] for p in keys]
            split = [*_grouped(grad_k, keys[0].shape[1]).split(lengths, dim=2),
                     *_grouped(grad_v, values[0].shape[1]).split(lengths, dim=2)]
            return (grad_q, None, None, None, *split)
        needs = (ctx.needs_input_grad[0],) + tuple(ctx.needs_input_grad[4:])
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(need) for t, need in zip([q, *pieces], needs)]
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
