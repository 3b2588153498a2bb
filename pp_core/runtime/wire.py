"""What travels between stages: tensor metadata, the forward header, packed messages.

A forward message may carry a fixed-size int64 *header* - count, dtype, requires-grad flag and
shape of every tensor - so shapes can change at every step. On a stage boundary whose shapes
were the same in the last two steps (:class:`ShapeHistory`, kept identically by both ends) a
message is one *packed* uint8 buffer instead: the header, then each tensor at a 64-byte-aligned
offset, whose size both ends know in advance. Backward messages are the gradients alone.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from pp_core.errors import PipelineError

__all__ = ["TensorMeta", "HEADER_LEN", "HEADER_BYTES", "TAG_HEADER", "TAG_FORWARD",
           "TAG_BACKWARD", "TAG_PACKED", "TAG_FIXUP", "encode_header", "decode_header",
           "same_buffers", "packed_nbytes", "pack", "unpack", "ShapeHistory", "ReceivedShapes"]

HEADER_LEN = 64
"""Numbers (int64) in a forward header: enough for e.g. 8 tensors of 5 dimensions."""

TAG_HEADER, TAG_FORWARD, TAG_BACKWARD = 1, 2, 3
TAG_PACKED, TAG_FIXUP = 4, 5
"""Packed messages, and the real tensors that follow a packed message whose predicted shapes
were wrong. Every kind of message has its own tag so that a backend that matches by tag (gloo)
never pairs a receive with a send of another kind, whatever order the two ends post them in."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class TensorMeta(NamedTuple):
    """What a receiver must know to allocate a buffer for one tensor; ``placements``: the
    DTensor placements of a sent DTensor (its local shard travels), empty for a plain tensor."""

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    placements: tuple = ()

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)


_HAS_PLACEMENTS = 2  # flag bit next to requires_grad (bit 0)


def encode_placements(placements: Sequence) -> list[int]:
    """DTensor placements as numbers: ``Replicate`` 0, ``Partial("sum")`` 1, ``Shard(d)`` 2 + d."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: torch.distributed

    codes = []
    for place in placements:
        if type(place) is Shard:
            codes.append(2 + place.dim)
        elif isinstance(place, Replicate):
            codes.append(0)
        elif isinstance(place, Partial) and place.reduce_op == "sum":
            codes.append(1)
        else:
            raise PipelineError(
                f"cannot send a DTensor with placement {place} between stages (supported: "
                f"Replicate, Shard(dim), Partial('sum')); redistribute it at the end of the stage "
                f"(a PrepareModuleOutput in the tensor-parallel plan) or return .to_local()")
    return codes


def decode_placements(codes: Sequence[int]) -> tuple:
    from torch.distributed.tensor import Partial, Replicate, Shard  # lazy: torch.distributed

    return tuple(Replicate() if c == 0 else Partial() if c == 1 else Shard(c - 2) for c in codes)


def encode_header(metas: Sequence[TensorMeta]) -> list[int]:
    """``[n, (dtype, flags, ndim, *shape[, nplacements, *placements]) * n]`` padded with zeros
    to ``HEADER_LEN``; flags: bit 0 requires grad, bit 1 a DTensor's placements follow."""
    values = [len(metas)]
    for meta in metas:
        code = _DTYPE_CODE.get(meta.dtype)
        if code is None:
            raise PipelineError(f"cannot send a tensor of dtype {meta.dtype} between stages; "
                                f"supported: {', '.join(str(d) for d in _DTYPES)}")
        flags = int(meta.requires_grad) | (_HAS_PLACEMENTS if meta.placements else 0)
        values += [code, flags, len(meta.shape), *meta.shape]
        if meta.placements:
            values += [len(meta.placements), *encode_placements(meta.placements)]
    if len(values) > HEADER_LEN:
        raise PipelineError(
            f"the stage output ({len(metas)} tensors, shapes {[m.shape for m in metas]}) needs "
            f"{len(values)} header numbers, more than HEADER_LEN={HEADER_LEN}; return fewer "
            f"tensors or fewer dimensions, or set pp_seq_len for static shapes")
    return values + [0] * (HEADER_LEN - len(values))


def decode_header(values: Sequence[int]) -> list[TensorMeta]:
    count, pos, metas = values[0], 1, []
    for _ in range(count):
        code, flags, ndim = values[pos:pos + 3]
        pos += 3
        shape = tuple(values[pos:pos + ndim])
        pos += ndim
        placements = ()
        if flags & _HAS_PLACEMENTS:
            count = values[pos]
            placements = decode_placements(values[pos + 1:pos + 1 + count])
            pos += 1 + count
        metas.append(TensorMeta(shape, _DTYPES[code], bool(flags & 1), placements))
    return metas


def same_buffers(a: Optional[Sequence[TensorMeta]], b: Sequence[TensorMeta]) -> bool:
    """Whether buffers allocated for metas ``a`` can receive metas ``b`` (shape and dtype)."""
    return a is not None and len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


HEADER_BYTES = HEADER_LEN * 8
_ALIGN = 64


def _bytes_meta(size: int) -> TensorMeta:
    return TensorMeta((size,), torch.uint8, False)


def _slots(metas: Sequence[TensorMeta]) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor in a packed message, after the header, 64-byte aligned."""
    slots, offset = [], HEADER_BYTES
    for meta in metas:
        numel = 1
        for size in meta.shape:
            numel *= size
        nbytes = numel * meta.dtype.itemsize
        slots.append((offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return slots


def packed_nbytes(metas: Sequence[TensorMeta]) -> int:
    slots = _slots(metas)
    return slots[-1][0] + slots[-1][1] if slots else HEADER_BYTES


def pack(header: list[int], tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta],
         device) -> torch.Tensor:
    """One uint8 message: the header, then each tensor (``None``: filler) at its slot."""
    buffer = torch.empty(packed_nbytes(metas), dtype=torch.uint8, device=device)
    buffer[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    for tensor, (offset, nbytes) in zip(tensors, _slots(metas)):
        if tensor is not None and nbytes:
            buffer[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
    return buffer


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Views of a packed message's tensors (no copy)."""
    return [buffer[offset:offset + nbytes].view(meta.dtype).view(meta.shape)
            for meta, (offset, nbytes) in zip(metas, _slots(metas))]


class ShapeHistory:
    """Shape prediction for headers: a stage boundary whose messages had the same metas, per
    microbatch, in the last two steps is *stable*; on it a message travels as one packed buffer
    (header, then the tensors) whose size both ends know from last step, so the receiver posts
    it at the ``RECV`` and no separate header is exchanged. If the sender's shapes changed after
    all, the packed buffer (of the predicted size) carries the new header and filler, and the
    real tensors follow one by one. Boundaries whose shapes keep changing are never predicted,
    so they pay neither filler nor a wrong guess."""

    def __init__(self):
        self.last: dict = {}
        self.current: dict = {}
        self.stable: set = set()

    def new_step(self) -> None:
        for edge, metas in self.current.items():
            if self.last.get(edge) == metas:
                self.stable.add(edge)
            else:
                self.stable.discard(edge)
            self.last[edge] = metas
        self.current = {}

    def predict(self, edge, microbatch) -> Optional[list]:
        return self.last[edge].get(microbatch) if edge in self.stable else None

    def record(self, edge, microbatch, metas) -> None:
        self.current.setdefault(edge, {})[microbatch] = metas


class ReceivedShapes:
    """Tensor metas the receiving side learned from headers, per edge (the receiving stage):
    with static shapes the first header's metas (``metas``), else the :class:`ShapeHistory` of
    every one (``history``). The :class:`~pp_core.runtime.mailbox.Mailbox` reports each decoded
    header here and asks here for the metas of a header-less message."""

    def __init__(self, static_shapes: bool):
        self.static_shapes = static_shapes
        self.metas: dict[int, list] = {}
        self.history = ShapeHistory()

    def edge_metas(self, message) -> list:
        return self.metas[message.edge]

    def has_edge_metas(self, message) -> bool:
        return message.edge in self.metas

    def header_decoded(self, message) -> None:
        if self.static_shapes:  # a step's first message on the edge sets the step's shapes
            self.metas[message.edge] = message.metas
        else:
            self.history.record(message.edge, message.microbatch, message.metas)
