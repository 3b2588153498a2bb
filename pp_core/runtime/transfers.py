"""The executor's SEND/RECV actions: what a stage's outputs and input gradients become on the wire.

Each function is the handler of one action kind, called as ``handler(context, state, action)``:
``state`` is the step's :class:`~pp_core.runtime.step_state.StepState` (they read and fill
``to_send``, ``grads_back``, ``messages``), ``context`` the executor's fixed
:class:`TransferContext` (the stages, the :class:`~pp_core.runtime.mailbox.Mailbox` they post
through, the shapes each boundary carried in earlier steps). Message formats:
:mod:`pp_core.runtime.wire`.

Forward messages carry a header unless ``pp_seq_len`` is set: then the first message of each
stage boundary in a step is packed with its header, sized by the last step's shapes (the very
first one ever has a plain header); the step's other messages on that boundary are bare payloads
of the shapes it announced, in receive buffers sized before they arrive. A batch of another
length is announced by that first message (re-sent at its real shapes, as a wrong prediction is
below), so a length that changes between steps runs on every rank, noted once in the log.
With dynamic shapes both ends predict a boundary's shapes from the last two steps
(:class:`~pp_core.runtime.wire.ShapeHistory`) and send header and payload as one packed buffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pp_core.errors import PipelineError
from pp_core.runtime.mailbox import Incoming, Mailbox
from pp_core.runtime.step_state import StepState
from pp_core.runtime.wire import (TAG_BACKWARD, TAG_FIXUP, TAG_FORWARD, TAG_PACKED, TensorMeta,
                                  ReceivedShapes, ShapeHistory, encode_header, pack,
                                  same_buffers)
from pp_core.schedule.ir import RECV_F

__all__ = ["BoundaryShapes", "TransferContext", "send_forward", "recv_forward", "send_backward",
           "recv_backward", "post_recv_backward", "prepost_forward"]

_FIRST_BACKWARD_TAG = 64  # above the tags of pp_core.runtime.wire

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class BoundaryShapes:
    """What the stage boundaries of this rank carried in earlier steps: kept from step to step."""

    received: ReceivedShapes  # what receivers learn from headers (the mailbox reports to it)
    sent: ShapeHistory = field(default_factory=ShapeHistory)  # dynamic: by receiving stage
    sent_metas: dict = field(default_factory=dict)  # pp_seq_len: the last shapes sent, by stage
    recv_started: set = field(default_factory=set)  # pp_seq_len: boundaries received on ever
    noted: bool = False  # pp_seq_len did not hold, said once


@dataclass(frozen=True, eq=False)
class TransferContext:
    """What the SEND/RECV handlers work with besides the step: fixed for the executor's life."""

    rank: int
    stages: dict
    mailbox: Mailbox
    num_microbatches: int
    static_shapes: bool
    device: Any
    actions: list  # the rank's program
    lifetime_at: dict  # program position of a RECV -> index of its buffer lifetime
    shapes: BoundaryShapes


def send_forward(ctx: TransferContext, state: StepState, action) -> None:
    stage_index = action.stage
    key = stage_index * ctx.num_microbatches + action.microbatch
    outs = state.to_send.pop(key)
    layouts = state.layouts.pop(key, None)  # DTensor outputs: local shards, placements in header
    metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad, layouts[i] if layouts else ())
             for i, t in enumerate(outs)]
    header = None
    tensors = [t.detach().contiguous() for t in outs]
    peer = ctx.stages[stage_index].next_rank
    if not ctx.static_shapes:
        header = encode_header(metas)
        edge, mb = stage_index + 1, action.microbatch
        predicted = ctx.shapes.sent.predict(edge, mb)
        ctx.shapes.sent.record(edge, mb, metas)
        if predicted is not None:  # the receiver posted one packed buffer of these shapes
            if same_buffers(predicted, metas):
                ctx.mailbox.send([pack(header, tensors, metas, ctx.device)], peer, TAG_PACKED)
                return
            ctx.mailbox.send([pack(header, [None] * len(predicted), predicted, ctx.device)]
                             + tensors, peer, (TAG_PACKED,) + (TAG_FIXUP,) * len(tensors))
            return
    else:
        known = ctx.shapes.sent_metas.get(stage_index)
        probe = stage_index not in state.probed  # this boundary's first message of the step
        state.probed.add(stage_index)
        if known is None:
            ctx.shapes.sent_metas[stage_index] = metas
            header = encode_header(metas)
        elif probe:  # header and payload packed, sized by the last step's shapes (both ends)
            header = encode_header(metas)
            if same_buffers(known, metas):
                ctx.shapes.sent_metas[stage_index] = metas
                ctx.mailbox.send([pack(header, tensors, metas, ctx.device)], peer, TAG_PACKED)
                return
            ctx.shapes.sent_metas[stage_index] = metas  # the rest of the step: these shapes
            shape_note(ctx, stage_index, known, metas)
            ctx.mailbox.send([pack(header, [None] * len(known), known, ctx.device)] + tensors,
                             peer, (TAG_PACKED,) + (TAG_FIXUP,) * len(tensors))
            return
        elif known != metas:
            raise PipelineError(
                f"stage {stage_index} output changed within a step, from {_describe(known)} to "
                f"{_describe(metas)}; with pp_seq_len set every microbatch of a step must have "
                f"the same shapes (a new length may come with the next step): unset pp_seq_len "
                f"to let shapes vary per microbatch, or pad the step's inputs to one length")
    ctx.mailbox.send(tensors, peer, TAG_FORWARD, header)


def shape_note(ctx: TransferContext, stage_index: int, known, metas) -> None:
    """Say once per pipeline, on its rank 0, that ``pp_seq_len`` did not hold (a hint)."""
    if ctx.rank != 0 or ctx.shapes.noted:
        return
    ctx.shapes.noted = True
    logger.warning("pp_seq_len is a hint, and a batch of another length arrived: stage %d "
                   "now sends %s instead of %s; each step runs with the shapes its first "
                   "message announces (noted once)", stage_index, _describe(metas),
                   _describe(known))


def recv_forward(ctx: TransferContext, state: StepState, action) -> None:
    if state.position in state.preposted:
        return
    stage_index = action.stage
    key = stage_index * ctx.num_microbatches + action.microbatch
    peer = ctx.stages[stage_index].prev_rank
    lifetime = ctx.lifetime_at.get(state.position, -1)
    if not ctx.static_shapes:
        predicted = ctx.shapes.received.history.predict(stage_index, action.microbatch)
        message = Incoming(peer, TAG_FORWARD if predicted is None else TAG_PACKED, None,
                           lifetime, predicted)
        header = True
    else:
        known = ctx.shapes.received.metas.get(stage_index)
        first = stage_index not in ctx.shapes.recv_started  # the first ever: a plain header
        probe = stage_index not in state.recv_probed  # this boundary's first message of the step
        ctx.shapes.recv_started.add(stage_index)
        state.recv_probed.add(stage_index)
        if first or known is None:
            message = Incoming(peer, TAG_FORWARD, None, lifetime)
            header = first
        elif probe:  # packed with its header, sized by the last step's shapes
            message = Incoming(peer, TAG_PACKED, None, lifetime, known)
            header = True
        else:  # the shapes of this step's first message on this boundary (decoded before it)
            message = Incoming(peer, TAG_FORWARD, None, lifetime)
            header = False
    message.edge = stage_index
    message.microbatch = action.microbatch
    state.messages[key] = ctx.mailbox.post(message, header)


def prepost_forward(ctx: TransferContext, state: StepState) -> None:
    """Tag-matching backends: post, at the start of the step, every forward receive whose size
    is known (a predicted packed message, or static shapes after the first step), so that
    senders never wait for the receiver to reach its ``RECV``. Receives of one tag are still
    posted in program order, which is all tag matching needs. All or none: a message posted
    later would queue behind later ones and wait for them when consumed."""
    recvs = [(position, action) for position, action in enumerate(ctx.actions)
             if action.kind is RECV_F]
    shapes = ctx.shapes.received
    for _, action in recvs:
        if ctx.static_shapes:
            if action.stage not in shapes.metas:
                return
        elif shapes.history.predict(action.stage, action.microbatch) is None:
            return
    for position, action in recvs:
        state.position = position
        recv_forward(ctx, state, action)
        state.preposted.add(position)


def send_backward(ctx: TransferContext, state: StepState, action) -> None:
    key = action.stage * ctx.num_microbatches + action.microbatch
    grads = state.grads_back.pop(key)
    if grads:
        tensors = [g.detach().contiguous() for g in grads]
        ctx.mailbox.send(tensors, ctx.stages[action.stage].prev_rank,
                         _backward_tag(ctx, key - ctx.num_microbatches))


def _backward_tag(ctx: TransferContext, key: int) -> int:
    """The tag of the gradient message for the outputs of ``key`` (stage * M + microbatch): on
    tag-matching backends one tag per message, so its receive may be posted at any time (the
    executor posts it as soon as the outputs exist); NCCL ignores tags."""
    return TAG_BACKWARD if ctx.mailbox.ordered else _FIRST_BACKWARD_TAG + key


def recv_backward(ctx: TransferContext, state: StepState, action) -> None:
    key = action.stage * ctx.num_microbatches + action.microbatch
    if key in state.preposted_b:
        state.preposted_b.discard(key)
        return
    post_recv_backward(ctx, state, action.stage, key, ctx.lifetime_at.get(state.position, -1))


def post_recv_backward(ctx: TransferContext, state: StepState, stage_index: int, key: int,
                       lifetime: int) -> None:
    outputs = state.outputs.get(key)
    if not outputs:
        return
    metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in outputs]
    message = Incoming(ctx.stages[stage_index].next_rank, _backward_tag(ctx, key), metas, lifetime)
    state.messages[-1 - key] = ctx.mailbox.post(message, False)


def _describe(metas) -> str:
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}"
                           for m in metas) + "]"
