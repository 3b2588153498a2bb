"""The messages a rank receives and sends, kept in program order per peer (:class:`Mailbox`).

A *message* is what one SEND/RECV pair of the lowered program moves: the tensors a stage hands
to the next (forward) or the input gradients it hands back (backward). Forward messages may carry
a small fixed-size *header* (count, dtype, requires-grad flag and shape of every tensor) so that
shapes can change every step and every microbatch; backward messages never need one (the
receiver of a gradient knows the shapes of the outputs it sent). The operations themselves go
through :class:`~pp_core.runtime.p2p.P2P`.

Ordering. NCCL matches point-to-point operations between two ranks in issue order, on one stream
per pair, so both ranks must issue the operations of a pair in the same order. The lowered
program guarantees that for whole messages; within a message the payload receive can only be
posted once its header has arrived (message formats: :mod:`pp_core.runtime.wire`). :class:`Mailbox` therefore keeps, per peer, the messages
whose header is posted but whose payload is not, and *flushes* them (waits for the header, posts
the payload receives) before anything else is issued to or from that peer, and at the latest
right before the message is consumed. Without a header the payload is posted at the ``RECV``.
Backends that match messages by tag (gloo: ``P2P.ordered`` is false) need no such flush, since
every kind of message has its own tag (:mod:`pp_core.runtime.wire`) and each kind is posted in
program order at both ends: there a pending header is only checked without blocking when other
operations are issued, and waited for when its message is consumed. Flushing there cost 2-7 ms
of blocking waits per step in the runtime benchmark (a receive posted early waited, at its
post, for the previous message of the same peer).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch

from pp_core.runtime.p2p import P2P
from pp_core.runtime.wire import (HEADER_BYTES, HEADER_LEN, TAG_FIXUP, TAG_HEADER, ReceivedShapes,
                                  TensorMeta, _bytes_meta, decode_header, packed_nbytes,
                                  same_buffers, unpack)

__all__ = ["Incoming", "Mailbox", "TensorMeta"]  # TensorMeta: from wire


class Incoming:
    """One message being received: header (optional), then one buffer per tensor."""

    __slots__ = ("peer", "tag", "metas", "header", "header_work", "tensors", "works", "lifetime",
                 "edge", "microbatch", "predicted", "queued", "packed")

    def __init__(self, peer: int, tag: int, metas: Optional[list], lifetime: int = -1,
                 predicted: Optional[list] = None):
        self.peer = peer
        self.tag = tag
        self.metas = metas
        self.header = None
        self.header_work = None
        self.tensors: Optional[list] = None
        self.works: list = []
        self.lifetime = lifetime
        self.edge = None
        self.microbatch = -1
        self.predicted = predicted  # predicted metas: receive header and payload packed in one
        self.queued = False
        self.packed = None


class Mailbox:
    """Posts receives in program order and keeps each peer's operations in program order.

    :param allocator: gives the receive buffers (``allocate``/``release``, see
        ``pp_core.runtime.allocator``).
    :param shapes: what the receiving side learned from headers
        (:class:`~pp_core.runtime.wire.ReceivedShapes`): told of every decoded header, asked
        for the metas of a header-less message whose edge learned them earlier (static shapes).
    """

    def __init__(self, p2p: P2P, allocator, device: torch.device, shapes: ReceivedShapes):
        self.p2p = p2p
        self.allocate = allocator.allocate
        self.release = allocator.release
        self.device = device
        self.shapes = shapes
        self.ordered = getattr(p2p, "ordered", True)
        self.unflushed: dict[int, deque] = {}
        self.sends: deque = deque()  # [work, tensor, peer, origin] in issue order
        self.sends_issued = 0
        self.sends_done = 0
        self.origin = -1
        """Program position of the action now running: the sends it issues carry it, and
        :meth:`settle` names sends by it (set by the executor)."""

    def post(self, message: Incoming, with_header: bool) -> Incoming:
        if self.unflushed.get(message.peer):
            self.flush(message.peer, blocking=self.ordered)
        if with_header and message.predicted is not None:
            # both ends predict alike (ShapeHistory): header and payload in one message
            size = packed_nbytes(message.predicted)
            (message.packed,) = self.allocate(message.lifetime, [_bytes_meta(size)])
            message.works = [self.p2p.irecv(message.packed, message.peer, message.tag)]
            message.queued = True
            self.unflushed.setdefault(message.peer, deque()).append(message)
        elif with_header:
            message.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            message.header_work = self.p2p.irecv(message.header, message.peer, TAG_HEADER)
            message.queued = True
            self.unflushed.setdefault(message.peer, deque()).append(message)
        elif message.metas is None:  # metas come from an earlier header on the same edge
            message.queued = True
            self.unflushed.setdefault(message.peer, deque()).append(message)
        else:
            self._post_payload(message, message.metas)
        return message

    def _post_payload(self, message: Incoming, metas) -> None:
        tensors = self.allocate(message.lifetime, metas) if metas else []
        message.tensors = tensors
        message.works = [self.p2p.irecv(t, message.peer, message.tag) for t in tensors]

    def flush(self, peer: int, upto: Optional[Incoming] = None, blocking: bool = True) -> None:
        """Post the payload of ``peer``'s pending messages, oldest first (up to ``upto``);
        ``blocking=False``: only those whose header has already arrived."""
        queue = self.unflushed.get(peer)
        while queue:
            message = queue[0]
            if not blocking and not self._arrived(message):
                return
            if message.packed is not None:
                for work in message.works:
                    self.p2p.wait(work, message.peer)
                packed, message.packed, message.works = message.packed, None, []
                message.metas = decode_header(packed[:HEADER_BYTES].view(torch.int64).tolist())
                self.shapes.header_decoded(message)
                queue.popleft()
                message.queued = False
                if same_buffers(message.predicted, message.metas):
                    message.tensors = unpack(packed, message.metas)
                else:  # the sender's shapes changed: the real payload follows, tensor by tensor
                    del packed
                    self.release(message.lifetime)
                    message.tag = TAG_FIXUP
                    self._post_payload(message, message.metas)
                if message is upto:
                    return
                continue
            if message.header_work is not None:
                self.p2p.wait(message.header_work, message.peer)
                message.header_work = None
                message.metas = decode_header(message.header.tolist())
                message.header = None
                self.shapes.header_decoded(message)
            elif message.metas is None:
                message.metas = self.shapes.edge_metas(message)
            queue.popleft()
            message.queued = False
            self._post_payload(message, message.metas)
            if message is upto:
                return

    def poll(self) -> None:
        """Post the payload of every pending message whose header has arrived (never blocks):
        the executor calls it between actions, so that the sender's data moves while this rank
        computes instead of when the message is consumed (first steps, shapes that change)."""
        for peer, queue in self.unflushed.items():
            if queue:
                self.flush(peer, blocking=False)

    def _arrived(self, message: Incoming) -> bool:
        if message.packed is not None:
            return all(work.is_completed() for work in message.works)
        if message.header_work is not None:
            return message.header_work.is_completed()
        return message.edge is None or self.shapes.has_edge_metas(message)

    def receive(self, message: Incoming) -> list:
        """Wait for ``message`` and return its tensors."""
        if message.queued:
            self.flush(message.peer, upto=message)
        for work in message.works:
            self.p2p.wait(work, message.peer)
        message.works = []
        return message.tensors

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int,
             header: Optional[list] = None) -> None:
        if self.unflushed.get(peer):
            self.flush(peer, blocking=self.ordered)
        p2p, origin = self.p2p, self.origin
        if header is not None:
            head = torch.tensor(header, dtype=torch.int64).to(self.device, non_blocking=True)
            self.sends.append([p2p.isend(head, peer, TAG_HEADER), head, peer, origin])
            self.sends_issued += 1
        tags = (tag,) * len(tensors) if isinstance(tag, int) else tag  # or one per tensor
        for tensor, tag in zip(tensors, tags):
            self.sends.append([p2p.isend(tensor, peer, tag), tensor, peer, origin])
            self.sends_issued += 1

    def settle(self, origins) -> None:
        """Wait for the sends issued at the program positions ``origins``, which the peer is
        known to have received (:meth:`~pp_core.schedule.lower.Program.send_acks`), and drop
        the tensors they hold; the wait returns at once."""
        for entry in self.sends:
            if entry[0] is not None and entry[3] in origins:
                self.p2p.wait(entry[0], entry[2])
                entry[0] = entry[1] = None

    def reap(self) -> None:
        """Forget finished sends, oldest first (never blocks)."""
        sends = self.sends
        while sends and (sends[0][0] is None or sends[0][0].is_completed()):
            sends.popleft()
            self.sends_done += 1

    def wait_sends(self) -> None:
        sends = self.sends
        while sends:
            work, _, peer, _ = sends[0]
            if work is not None:
                self.p2p.wait(work, peer)
            sends.popleft()
            self.sends_done += 1

    def clear(self) -> None:
        self.unflushed.clear()
        self.sends.clear()
