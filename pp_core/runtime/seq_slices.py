"""Sequence slices at run time: what a stage's forward of one slice sees, and the backward's share.

With ``pipeline.pp_seq_chunks = K`` each microbatch runs as K causal slices (units of the
schedule, :mod:`pp_core.schedule.slices`). Slice ``j``'s attention reads the keys and values of
slices ``< j`` of the same microbatch on the same stage. The executor makes one
:class:`SeqSlice` per slice forward and makes it current (:func:`current_seq_slice`) while the
stage runs; a model's attention asks it for the keys and values of the whole prefix
(:meth:`SeqSlice.keys_values`) and, for a packed document mask, for the prefix of its position
ids (:meth:`SeqSlice.prefix`).

Why detached leaves. Slice ``j``'s backward runs before slice ``j-1``'s (reverse order), so it
must not run backward through slice ``j-1``'s graph: each slice's keys and values reach later
slices as *leaves* (``detach().requires_grad_()``). A later slice's backward gives those leaves
their gradient (accumulated over the later slices, kept on ``leaf.grad``); the earlier slice's
own backward then starts from its outputs *and* its keys and values with those gradients
(:func:`backward_roots`). Under a split backward the leaves are inputs of ``I`` (the gradient
an earlier slice waits for), never of ``W``. Nothing is recomputed and nothing is lost: the sum
over slices is the unsliced backward.

Everything lives in the step's state (``slice_store``: per (stage, microbatch) the prefix caches,
dropped after the last slice's forward; ``slice_kept``/``slice_read``: per unit, the pairs it
made and the leaves it read), so a failed step clears it with the rest.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as functional
from torch.overrides import TorchFunctionMode

from pp_core.errors import ConfigError
from pp_core.losses import resolve_loss
from pp_core.parallel.activation import replay_in_recompute
from pp_core.parallel.compile import run_eagerly_when_compiled
from pp_core.runtime.microbatch import _rebuild, iter_tensors
from pp_core.runtime.prefix_attention import causal_block_mask, prefix_attention

__all__ = ["SeqSlice", "current_seq_slice", "running", "replaying", "backward_roots",
           "cut_sequence",
           "join_sequence", "check_sliceable"]

_current: list = []  # the slice whose forward runs (a stack: a stage never nests, tests might)


def current_seq_slice() -> Optional["SeqSlice"]:
    """The slice whose forward runs now, or ``None`` (no slices, or outside a pipeline step).
    A model that attends takes the prefix's keys and values from it."""
    return _current[-1] if _current else None


class SeqSlice:
    """One slice's forward on one stage: its place in the sequence and the prefix caches."""

    def __init__(self, index: int, count: int, store: dict):
        self.index = index  # which slice of its microbatch (0-based)
        self.count = count  # slices per microbatch (K)
        self._store = store  # owner -> cached prefix pieces, shared by the microbatch's slices
        self.kept: list = []  # (tensor, leaf): what this slice made for later slices
        self.read: list = []  # leaves of earlier slices this slice attends to
        self.replaying = False  # an activation-checkpointing recompute of this forward runs
        self.pending = None  # pieces() for the next routed SDPA call (routing())
        self._seen: dict = {}  # (name, owner) -> the earlier pieces the forward read (a
        # recompute reads them again: the store has moved on, or gone)

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def offset(self, length: int) -> int:
        """Tokens before this slice when every slice has ``length`` tokens (equal slices)."""
        return self.index * length

    def keys_values(self, owner, *tensors: torch.Tensor, dim: int = -2) -> tuple:
        """``tensors`` (this slice's keys and values of one attention ``owner``) concatenated
        after the same tensors of the earlier slices along ``dim`` (the sequence). In a
        recompute (:func:`replaying`) the same earlier pieces, and nothing kept or read again.
        An attention that feeds them to autograd saves the concatenation (``O(K^2)`` bytes
        over a microbatch): :meth:`attention` does not."""
        return self.joined(self._earlier(owner, tensors) + [tensors], dim)

    @staticmethod
    def joined(pieces: list, dim: int = 2) -> tuple:
        """``pieces`` (one tuple of tensors per slice, as :meth:`pieces` gives them) as one
        tuple, each position's tensors concatenated along ``dim`` (the sequence)."""
        if len(pieces) == 1:
            return tuple(pieces[0])
        return tuple(torch.cat(column, dim=dim) for column in zip(*pieces))

    def attention(self, owner, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor] = None, scale: Optional[float] = None):
        """Causal attention of this slice's queries ``q`` over the prefix's keys and values
        (``[batch, heads, seq, head_dim]``; ``k``, ``v`` this slice's, of attention ``owner``;
        fewer key/value heads than query heads is grouped-query attention), or under
        ``mask`` (bool, the query block against the prefix). Autograd saves the per-slice
        pieces only, never their concatenation (:mod:`pp_core.runtime.prefix_attention`).
        Inside blocks compiled by ``apply_compile`` it runs eagerly (its bookkeeping and the
        prefix attention's backward are not traceable)."""
        pieces = self._earlier(owner, (k, v))
        return self.attend(pieces + [(k, v)], q, mask, scale)

    def pieces(self, owner, *tensors: torch.Tensor) -> list:
        """The prefix's pieces of attention ``owner``: one tuple like ``tensors`` (keys, values)
        per slice so far (earlier slices' as leaves, then ``tensors``). For an attention that
        cannot call :meth:`attention` itself (an HF layer): under :meth:`routing` its next
        ``scaled_dot_product_attention`` call is answered by :meth:`attend` over them."""
        self.pending = self._earlier(owner, tensors) + [tensors]
        return self.pending

    def routing(self) -> "_Routing":
        """A torch function mode: while it is active, the first ``scaled_dot_product_attention``
        call after :meth:`pieces` runs as :meth:`attend` over those pieces (its keys and values
        arguments, their concatenation, are dropped unused). :func:`replaying` enters it too,
        so a checkpointed layer's recompute saves what its forward saved."""
        return _Routing(self)

    @staticmethod
    def attend(pieces: list, q: torch.Tensor, mask: Optional[torch.Tensor] = None,
               scale: Optional[float] = None) -> torch.Tensor:
        """:meth:`attention` over ``pieces`` (:meth:`pieces`), already registered."""
        *pieces, (k, v) = pieces
        if not pieces:
            return functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1])
        return prefix_attention(q, [p[0] for p in pieces] + [k], [p[1] for p in pieces] + [v],
                                mask, scale)

    def _earlier(self, owner, tensors: tuple) -> list:
        """The earlier slices' pieces (tuples like ``tensors``) of attention ``owner``; this
        slice's join them (as leaves) for the later slices, unless it is the last."""
        key = ("kv", id(owner))
        if self.replaying:
            return self._seen.get(key, [])
        earlier = self._store.setdefault(key, [])
        for leaves in earlier:
            self.read += [leaf for leaf in leaves if leaf.requires_grad]
        if not self.last:
            leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
            self.kept += [(t, leaf) for t, leaf in zip(tensors, leaves) if t.requires_grad]
            pieces = list(earlier)
            earlier.append(leaves)
        else:
            pieces = earlier
        self._seen[key] = list(pieces)
        return pieces

    def prefix(self, owner, name: str, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """``tensor`` (no gradient: position ids, document ids) after the earlier slices' along
        ``dim``; kept as a copy, so a receive buffer that held it may be reused."""
        key = (name, id(owner))
        earlier = self._seen.get(key, []) if self.replaying else \
            self._store.setdefault(key, [])
        full = torch.cat(earlier + [tensor], dim=dim) if earlier else tensor
        if self.replaying:
            return full
        self._seen[key] = list(earlier)
        if not self.last:
            earlier.append(tensor.detach().clone())
        return full

    def causal_mask(self, queries: int, keys: int, device) -> torch.Tensor:
        """``[queries, keys]`` bool: query ``i`` (at ``keys - queries + i``) sees keys up to it."""
        return causal_block_mask(queries, keys, device)


class _Routing(TorchFunctionMode):
    """:meth:`SeqSlice.routing`. A call it cannot answer exactly (dropout on, a float mask, no
    pieces pending) runs as made."""

    def __init__(self, piece: SeqSlice):
        super().__init__()
        self.piece = piece

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pieces = self.piece.pending
        if func is functional.scaled_dot_product_attention and pieces is not None:
            self.piece.pending = None  # the pieces are for this call only, answered or not
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if len(pieces) > 1 and not dropout and (mask is None or mask.dtype == torch.bool):
                return SeqSlice.attend(pieces, args[0], mask, kwargs.get("scale"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def running(piece: SeqSlice):
    """Make ``piece`` current while its stage's forward runs."""
    _current.append(piece)
    try:
        yield piece
    finally:
        _current.pop()


@contextlib.contextmanager
def replaying(piece: Optional[SeqSlice]):
    """Make ``piece`` current again while an activation-checkpointing recompute of its forward
    runs (during a backward, outside the forward's :func:`running`): its attention reads the
    same prefix (``None``: no slices, nothing to do)."""
    if piece is None:
        yield
        return
    piece.replaying = True
    _current.append(piece)
    try:
        with piece.routing():
            yield
    finally:
        _current.pop()
        piece.replaying = False


def _replay_current():
    """For activation checkpointing: the recompute of a checkpointed block whose forward runs
    now re-enters this slice (:func:`replaying`); ``None`` outside slices."""
    piece = current_seq_slice()
    return None if piece is None else functools.partial(replaying, piece)


replay_in_recompute(_replay_current)
run_eagerly_when_compiled(SeqSlice, "attention")


def backward_roots(outputs: list, grads, kept: list) -> tuple[list, Optional[list]]:
    """A unit's backward roots: its outputs plus the keys and values it made for later slices,
    with the gradients those slices left on the leaves (pairs without one are dropped)."""
    extra = [(t, leaf.grad) for t, leaf in kept if leaf.grad is not None]
    if not extra:
        return outputs, grads
    if grads is None:
        grads = [torch.ones_like(out) for out in outputs]
    return list(outputs) + [t for t, _ in extra], list(grads) + [g for _, g in extra]


def cut_sequence(value, count: int, what: str) -> list:
    """``value`` (one microbatch's inputs, targets or keyword inputs) cut into ``count`` equal
    slices along dim 1, the sequence: every tensor of 2+ dims whose dim 1 is the sequence length
    (that of the first such tensor) is cut, anything else goes to every slice unchanged.

    :raises ConfigError: a sequence shorter than ``count`` or not divisible by it.
    """

    length = next((t.shape[1] for t in iter_tensors(value) if t.dim() >= 2), None)
    if length is None:
        return [value] * count
    if count > length or length % count:
        raise ConfigError(
            f"pipeline.pp_seq_chunks={count} cannot cut {what} of {length} tokens per sequence "
            f"into equal slices; use a divisor of {length} (e.g. "
            f"{max(d for d in range(1, min(count, length) + 1) if length % d == 0)})",
            field="pp_seq_chunks")

    def cut(item):
        if isinstance(item, torch.Tensor):
            if item.dim() >= 2 and item.shape[1] == length:
                return list(item.chunk(count, dim=1))
            return [item] * count
        if isinstance(item, (tuple, list)):
            parts = [cut(x) for x in item]
            return [_rebuild(item, [p[k] for p in parts]) for k in range(count)]
        if isinstance(item, dict):
            parts = {key: cut(x) for key, x in item.items()}
            return [{key: parts[key][k] for key in item} for k in range(count)]
        return [item] * count

    return cut(value)


def join_sequence(outputs: list, count: int) -> list:
    """Per-slice outputs (units in order) back to per-microbatch ones, along dim 1."""

    def join(items):
        head = items[0]
        if isinstance(head, torch.Tensor):
            return torch.cat(items, dim=1) if head.dim() >= 2 else torch.stack(items).sum(0)
        if isinstance(head, (tuple, list)):
            return _rebuild(head, [join([x[i] for x in items]) for i in range(len(head))])
        if isinstance(head, dict):
            return {key: join([x[key] for x in items]) for key in head}
        return head

    return [join(outputs[i:i + count]) for i in range(0, len(outputs), count)]


def cut_units(parts: list, count: int, what: str) -> list:
    """Each microbatch's ``count`` slices, in the schedule's unit order (``count`` 1: as given)."""
    if count == 1:
        return parts
    return [piece for part in parts for piece in cut_sequence(part, count, what)]


def sliced_loss(model_parts, loss_fn, counts_tokens: bool, count: int):
    """``(loss_fn, shift_targets)`` a step of ``count`` slices per microbatch runs, the model
    and loss checked (:func:`check_sliceable`). A loss that shifts its labels would lose each
    slice's last target: the whole row is shifted once instead (:func:`shift_labels`), then the
    loss is plain ``cross_entropy``."""
    if count == 1:
        return loss_fn, False
    check_sliceable(model_parts, loss_fn, counts_tokens)
    if getattr(loss_fn, "shifts_labels", False):
        return resolve_loss("cross_entropy"), True
    return loss_fn, False


def check_sliceable(model_parts, loss_fn, counts_tokens: bool) -> None:
    """Refuse slices a model or loss cannot take, by name, before any traffic: the model must
    say ``pp_seq_slices = True`` (its attention reads :func:`current_seq_slice`), and the loss
    must be token-normalised over the step (a per-slice mean would weigh slices, not tokens)."""

    for part in model_parts:
        inner = getattr(part, "module", part)  # a DDP wrapper keeps the model as .module
        if not getattr(inner, "pp_seq_slices", False):
            raise ConfigError(
                f"pipeline.pp_seq_chunks > 1: model {type(inner).__name__!r} cannot take "
                f"sequence slices (its attention does not read the earlier slices' keys and "
                f"values: no pp_seq_slices = True); set pp_seq_chunks: 1, or use gpt, moe_gpt "
                f"or a supported Hugging Face decoder", field="pp_seq_chunks")
    if loss_fn is not None and not counts_tokens:
        raise ConfigError(
            f"pipeline.pp_seq_chunks > 1 needs a loss normalised over the step's valid tokens "
            f"(e.g. 'cross_entropy'); {getattr(loss_fn, '__name__', loss_fn)!r} is not, so "
            f"slices would change the result; set pp_seq_chunks: 1", field="pp_seq_chunks")


def shift_labels(labels):
    """Next-token targets of labels that are the input ids (an HF loss shifts them itself, which
    inside a slice would drop the slice's last target): ``labels[:, 1:]`` and ``-100`` last."""
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        raise ConfigError("pipeline.pp_seq_chunks > 1 with a loss that shifts its labels needs "
                          "the labels as one [batch, seq] tensor", field="pp_seq_chunks")
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
