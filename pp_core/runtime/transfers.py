"""The executor's SEND/RECV actions: what a stage's outputs and input gradients become on the wire.

Each function is the handler of one action kind, called as ``handler(executor, action)`` like the
compute handlers in :mod:`pp_core.runtime.executor`; they read and fill the step's state there
(``to_send``, ``grads_back``, ``messages``) and post through its
:class:`~pp_core.runtime.comm.Mailbox`. Message formats: :mod:`pp_core.runtime.wire`.

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

from pp_core.errors import PipelineError
from pp_core.runtime.comm import Incoming
from pp_core.runtime.wire import (TAG_BACKWARD, TAG_FIXUP, TAG_FORWARD, TAG_PACKED, TensorMeta,
                                  encode_header, pack, same_buffers)
from pp_core.schedule.ir import RECV_F

__all__ = ["send_forward", "recv_forward", "send_backward", "recv_backward", "post_recv_backward",
           "prepost_forward"]

_FIRST_BACKWARD_TAG = 64  # above the tags of pp_core.runtime.wire

logger = logging.getLogger(__name__)


def send_forward(ex, action) -> None:
    stage_index = action.stage
    key = stage_index * ex.num_microbatches + action.microbatch
    outs = ex.to_send.pop(key)
    layouts = ex.layouts.pop(key, None)  # DTensor outputs: local shards, placements in headers
    metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad, layouts[i] if layouts else ())
             for i, t in enumerate(outs)]
    header = None
    tensors = [t.detach().contiguous() for t in outs]
    peer = ex.stages[stage_index].next_rank
    if not ex.static_shapes:
        header = encode_header(metas)
        edge, mb = stage_index + 1, action.microbatch
        predicted = ex.shapes_sent.predict(edge, mb)
        ex.shapes_sent.record(edge, mb, metas)
        if predicted is not None:  # the receiver posted one packed buffer of these shapes
            if same_buffers(predicted, metas):
                ex.mailbox.send([pack(header, tensors, metas, ex.device)], peer, TAG_PACKED)
                return
            ex.mailbox.send([pack(header, [None] * len(predicted), predicted, ex.device)]
                            + tensors, peer, (TAG_PACKED,) + (TAG_FIXUP,) * len(tensors))
            return
    else:
        known = ex.sent_metas.get(stage_index)
        probe = stage_index not in ex.probed  # this boundary's first message of the step
        ex.probed.add(stage_index)
        if known is None:
            ex.sent_metas[stage_index] = metas
            header = encode_header(metas)
        elif probe:  # header and payload packed, sized by the last step's shapes (both ends)
            header = encode_header(metas)
            if same_buffers(known, metas):
                ex.sent_metas[stage_index] = metas
                ex.mailbox.send([pack(header, tensors, metas, ex.device)], peer, TAG_PACKED)
                return
            ex.sent_metas[stage_index] = metas  # the rest of the step: these shapes
            shape_note(ex, stage_index, known, metas)
            ex.mailbox.send([pack(header, [None] * len(known), known, ex.device)] + tensors,
                            peer, (TAG_PACKED,) + (TAG_FIXUP,) * len(tensors))
            return
        elif known != metas:
            raise PipelineError(
                f"stage {stage_index} output changed within a step, from {_describe(known)} to "
                f"{_describe(metas)}; with pp_seq_len set every microbatch of a step must have "
                f"the same shapes (a new length may come with the next step): unset pp_seq_len "
                f"to let shapes vary per microbatch, or pad the step's inputs to one length")
    ex.mailbox.send(tensors, peer, TAG_FORWARD, header)


def shape_note(ex, stage_index: int, known, metas) -> None:
    """Say once per pipeline, on its rank 0, that ``pp_seq_len`` did not hold (a hint)."""
    if ex.rank != 0 or ex.shape_noted:
        return
    ex.shape_noted = True
    logger.warning("pp_seq_len is a hint, and a batch of another length arrived: stage %d "
                   "now sends %s instead of %s; each step runs with the shapes its first "
                   "message announces (noted once)", stage_index, _describe(metas),
                   _describe(known))


def recv_forward(ex, action) -> None:
    if ex.position in ex.preposted:
        return
    stage_index = action.stage
    key = stage_index * ex.num_microbatches + action.microbatch
    peer = ex.stages[stage_index].prev_rank
    lifetime = ex.lifetime_at.get(ex.position, -1)
    if not ex.static_shapes:
        predicted = ex.shapes_received.history.predict(stage_index, action.microbatch)
        message = Incoming(peer, TAG_FORWARD if predicted is None else TAG_PACKED, None,
                           lifetime, predicted)
        header = True
    else:
        known = ex.shapes_received.metas.get(stage_index)
        first = stage_index not in ex.recv_started  # the first message ever: a plain header
        probe = stage_index not in ex.recv_probed  # this boundary's first message of the step
        ex.recv_started.add(stage_index)
        ex.recv_probed.add(stage_index)
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
    ex.messages[key] = ex.mailbox.post(message, header)


def prepost_forward(ex) -> None:
    """Tag-matching backends: post, at the start of the step, every forward receive whose size
    is known (a predicted packed message, or static shapes after the first step), so that
    senders never wait for the receiver to reach its ``RECV``. Receives of one tag are still
    posted in program order, which is all tag matching needs. All or none: a message posted
    later would queue behind later ones and wait for them when consumed."""
    recvs = [(position, action) for position, action in enumerate(ex.program.actions)
             if action.kind is RECV_F]
    shapes = ex.shapes_received
    for _, action in recvs:
        if ex.static_shapes:
            if action.stage not in shapes.metas:
                return
        elif shapes.history.predict(action.stage, action.microbatch) is None:
            return
    for position, action in recvs:
        ex.position = position
        recv_forward(ex, action)
        ex.preposted.add(position)


def send_backward(ex, action) -> None:
    key = action.stage * ex.num_microbatches + action.microbatch
    grads = ex.grads_back.pop(key)
    if grads:
        tensors = [g.detach().contiguous() for g in grads]
        ex.mailbox.send(tensors, ex.stages[action.stage].prev_rank,
                        _backward_tag(ex, key - ex.num_microbatches))


def _backward_tag(ex, key: int) -> int:
    """The tag of the gradient message for the outputs of ``key`` (stage * M + microbatch): on
    tag-matching backends one tag per message, so its receive may be posted at any time (the
    executor posts it as soon as the outputs exist); NCCL ignores tags."""
    return TAG_BACKWARD if ex.mailbox.ordered else _FIRST_BACKWARD_TAG + key


def recv_backward(ex, action) -> None:
    key = action.stage * ex.num_microbatches + action.microbatch
    if key in ex.preposted_b:
        ex.preposted_b.discard(key)
        return
    post_recv_backward(ex, action.stage, key, ex.lifetime_at.get(ex.position, -1))


def post_recv_backward(ex, stage_index: int, key: int, lifetime: int) -> None:
    outputs = ex.outputs.get(key)
    if not outputs:
        return
    metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in outputs]
    message = Incoming(ex.stages[stage_index].next_rank, _backward_tag(ex, key), metas, lifetime)
    ex.messages[-1 - key] = ex.mailbox.post(message, False)


def _describe(metas) -> str:
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}"
                           for m in metas) + "]"
