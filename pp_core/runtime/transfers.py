"""The executor's SEND/RECV actions: what a stage's outputs and input gradients become on the wire.

Each function is the handler of one action kind, called as ``handler(executor, action)`` like the
compute handlers in :mod:`pp_core.runtime.executor`; they read and fill the step's state there
(``to_send``, ``grads_back``, ``messages``) and post through its
:class:`~pp_core.runtime.comm.Mailbox`. Message formats: :mod:`pp_core.runtime.wire`.

Forward messages carry a header unless shapes are static (``pp_seq_len``): then only the first
message of each stage boundary does, and the shapes it announced are checked on every later send.
With dynamic shapes both ends predict a boundary's shapes from the last two steps
(:class:`~pp_core.runtime.wire.ShapeHistory`) and send header and payload as one packed buffer.
"""

from __future__ import annotations

from pp_core.errors import PipelineError
from pp_core.runtime.comm import Incoming
from pp_core.runtime.wire import (TAG_BACKWARD, TAG_FIXUP, TAG_FORWARD, TAG_PACKED, TensorMeta,
                                  encode_header, pack, same_buffers)
from pp_core.schedule.ir import RECV_F

__all__ = ["send_forward", "recv_forward", "send_backward", "recv_backward", "post_recv_backward",
           "prepost_forward"]

_FIRST_BACKWARD_TAG = 64  # above the tags of pp_core.runtime.wire


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
        if known is None:
            ex.sent_metas[stage_index] = metas
            header = encode_header(metas)
        elif known != metas:
            raise PipelineError(
                f"stage {stage_index} output changed from {_describe(known)} to "
                f"{_describe(metas)}, but pp_seq_len is set, which promises static shapes; "
                f"unset pp_seq_len to let shapes vary, or pad inputs to pp_seq_len")
    ex.mailbox.send(tensors, peer, TAG_FORWARD, header)


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
        header = stage_index not in ex.recv_started
        ex.recv_started.add(stage_index)
        message = Incoming(peer, TAG_FORWARD, ex.shapes_received.metas.get(stage_index), lifetime)
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
