"""The executor: runs this rank's lowered program, one action after the other, and nothing else.

The program (see :mod:`pp_core.schedule.lower`) decides what runs and in which order; the
executor only knows how to run each kind of action:

* ``RECV_F``/``RECV_B`` post the receive of a message (:class:`~pp_core.runtime.comm.Mailbox`);
* ``F`` takes its inputs (the microbatch on the first stage, a received message, or the output
  of the previous stage when it lives on this rank), runs the stage, and on the last stage the
  loss; before the first forward of each microbatch on this rank it prepares the runtime
  initializers;
* ``B`` is the full backward, ``I``/``W`` the split one (:mod:`pp_core.runtime.backward`); the
  gradients of the stage inputs go to ``SEND_B`` or, on this rank, to the previous stage;
* ``SEND_F``/``SEND_B`` post the send of what the preceding compute produced.

Forward messages carry a header unless shapes are static (``pp_seq_len``): then only the first
message of each stage boundary does, and the shapes it announced are checked on every later send.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from pp_core.errors import PipelineError
from pp_core.runtime.backward import backward_full, backward_input, backward_weight
from pp_core.runtime.comm import Incoming, Mailbox, P2P
from pp_core.runtime.dp_sync import DataParallelDriver
from pp_core.runtime.wire import (TAG_BACKWARD, TAG_FIXUP, TAG_FORWARD, TAG_PACKED, ShapeHistory,
                                  TensorMeta, encode_header, pack, same_buffers)
from pp_core.runtime.microbatch import num_tokens
from pp_core.runtime.stage import Stage, as_outputs, make_stage_inputs
from pp_core.schedule.ir import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W
from pp_core.schedule.lower import RankProgram

__all__ = ["Executor"]

_FIRST_BACKWARD_TAG = 64  # above the tags of pp_core.runtime.wire


class Executor:
    """Runs one rank's program for one step (training) or one forward pass (evaluation)."""

    def __init__(self, program: RankProgram, stages: dict[int, Stage], p2p: P2P, allocator, *,
                 train: bool, loss_fn=None, scale: float = 1.0, initializers=(),
                 device: torch.device, dtype=None, static_shapes: bool = False):
        self.program = program
        self.rank = program.rank
        self.stages = stages
        self.p2p = p2p
        self.allocator = allocator
        self.train = train
        self.loss_fn = loss_fn
        self.scale = scale
        self.initializers = list(initializers)
        self.device = device
        self.dtype = dtype
        self.static_shapes = static_shapes
        self.mailbox = Mailbox(p2p, allocator, device)
        self.shapes_sent = ShapeHistory()  # dynamic shapes: keyed by the receiving stage
        # what receivers learn from headers; the mailbox calls into it (not into the executor,
        # which owns the mailbox: a reference cycle would keep the model alive after del)
        shapes = _ReceivedShapes(static_shapes)
        self.shapes_received = shapes.history
        self.recv_metas: dict[int, list] = shapes.metas  # static shapes: stage -> input metas
        self.mailbox.edge_metas = shapes.edge_metas
        self.mailbox.header_decoded = shapes.header_decoded
        self.mailbox.has_edge_metas = shapes.has_edge_metas
        self.num_microbatches = program.num_microbatches
        self.current = None  # the action being run, for error messages
        actions = program.actions
        self.lifetime_at = {lt.posted: index for index, lt in enumerate(program.recv_lifetimes)}
        self.release_at: dict[int, list[int]] = {}
        for index, lt in enumerate(program.recv_lifetimes):
            self.release_at.setdefault(lt.released, []).append(index)
        seen, self.prepare_at = set(), set()
        for position, action in enumerate(actions):
            if action.kind is F and action.microbatch not in seen:
                seen.add(action.microbatch)
                self.prepare_at.add(position)
        self.track_release = callable(getattr(allocator, "release", None)) and \
            type(allocator).__name__ != "DefaultRecvBufferAllocator"
        self.pending_release: list[tuple[int, int]] = []
        self.consume = getattr(allocator, "consume", None)
        self.recv_started: set[int] = set()
        self.sent_metas: dict[int, list] = {}
        self.prepost = True  # post receives before their RECV where the backend allows it
        self.prepost_backward = True
        self.prepost_b = False
        self.preposted: set = set()
        self.preposted_b: set = set()
        self.trace: Optional[list] = None  # (action, start, end) per action when tracing
        self.data_parallel = DataParallelDriver()  # torch DP engines of the stages (dp_sync)
        # plain functions, called as handler(executor, action): bound methods stored on the
        # executor would make a reference cycle that keeps the model alive after ``del pipe``
        self.handlers = dict(_HANDLERS)

    # ------------------------------------------------------------------ step
    def run(self, mb_inputs: Optional[list], mb_targets: Optional[list],
            mb_kwargs: Optional[list] = None):
        """Run the program once. Returns ``(losses, outputs)`` (lists by microbatch; empty when
        this rank does not hold the last stage). ``mb_kwargs``: per microbatch, keyword inputs
        for every stage."""
        M = self.num_microbatches
        self.mb_kwargs = mb_kwargs
        self.shapes_sent.new_step()
        self.shapes_received.new_step()
        self.mb_inputs = mb_inputs
        self.mb_targets = mb_targets
        self.inputs: dict[int, Any] = {}      # key -> stage inputs needing grad
        self.outputs: dict[int, list] = {}    # key -> outputs needing grad (scaled loss last)
        self.to_send: dict[int, tuple] = {}   # key -> outputs for SEND_F / local hand-off
        self.messages: dict[int, Incoming] = {}   # RECV_F keys (>= 0), RECV_B keys (< 0)
        self.grads_back: dict[int, list] = {}  # key -> input grads for SEND_B / local hand-off
        self.weight: dict[int, Any] = {}
        self.losses: list = [None] * M
        self.results: list = [None] * M
        handlers = self.handlers
        mailbox = self.mailbox
        self.preposted = set()
        self.preposted_b = set()
        early = self.prepost and not mailbox.ordered and not self.track_release
        self.prepost_b = early and self.prepost_backward
        if early:
            self._prepost_forward()
        self.data_parallel.begin_step()
        release_at = self.release_at
        trace = self.trace
        clock = time.perf_counter
        for position, action in enumerate(self.program.actions):
            self.current = action
            self.position = position
            if trace is None:
                handlers[action.kind](self, action)
            else:
                start = clock()
                handlers[action.kind](self, action)
                trace.append((str(action), start, clock()))
            if mailbox.unflushed and not mailbox.ordered:
                mailbox.poll()
            if position in release_at and self.track_release:
                issued = mailbox.sends_issued
                self.pending_release += [(issued, index) for index in release_at[position]]
                self._release(blocking=False)
        self.current = None
        if trace is not None:
            start = clock()
            mailbox.wait_sends()
            trace.append(("wait_sends", start, clock()))
        else:
            mailbox.wait_sends()
        self._release(blocking=True)
        reset = getattr(self.allocator, "reset", None)
        if reset is not None:
            reset()
        leftovers = [name for name in ("inputs", "outputs", "to_send", "messages", "grads_back",
                                       "weight") if getattr(self, name)]
        if leftovers:
            raise PipelineError(f"rank {self.rank}: the program left work undone ({leftovers}); "
                                f"the schedule is incomplete - run validate_schedule() on it")
        losses = [loss for loss in self.losses if loss is not None]
        outputs = [out for out in self.results if out is not None]
        self.mb_inputs = self.mb_targets = self.mb_kwargs = self.losses = self.results = None
        return losses, outputs

    def _prepost_forward(self) -> None:
        """Tag-matching backends: post, at the start of the step, every forward receive whose
        size is known (a predicted packed message, or static shapes after the first step), so
        that senders never wait for the receiver to reach its ``RECV``. Receives of one tag are
        still posted in program order, which is all tag matching needs. All or none: a
        message posted later would queue behind later ones and wait for them when consumed."""
        recvs = [(position, action) for position, action in enumerate(self.program.actions)
                 if action.kind is RECV_F]
        for _, action in recvs:
            if self.static_shapes:
                if action.stage not in self.recv_metas:
                    return
            elif self.shapes_received.predict(action.stage, action.microbatch) is None:
                return
        for position, action in recvs:
            self.position = position
            self._recv_f(action)
            self.preposted.add(position)

    def _release(self, blocking: bool) -> None:
        mailbox = self.mailbox
        mailbox.reap()
        keep = []
        for issued, index in self.pending_release:
            if blocking or issued <= mailbox.sends_done:
                self.allocator.release(index)
            else:
                keep.append((issued, index))
        self.pending_release = keep

    def abort(self) -> None:
        """Drop every tensor and pending operation of a failed step."""
        for name in ("inputs", "outputs", "to_send", "messages", "grads_back", "weight"):
            if hasattr(self, name):
                getattr(self, name).clear()
        self.mailbox.clear()
        self.pending_release = []
        self.data_parallel.abort()
        reset = getattr(self.allocator, "reset", None)
        if reset is not None:
            try:
                reset()
            except Exception:
                pass

    # ------------------------------------------------------------------ forward
    def _forward(self, action) -> None:
        stage_index, _, mb = action
        stage = self.stages[stage_index]
        M = self.num_microbatches
        key = stage_index * M + mb
        train = self.train
        if stage.is_first:
            if self.mb_inputs is None:
                raise PipelineError("the first stage needs the step's inputs on this rank")
            args = self.mb_inputs[mb]
        elif stage.local_prev:
            args = make_stage_inputs(self.to_send.pop(key - M), train)
        else:
            message = self.messages.pop(key)
            tensors = self.mailbox.receive(message)
            if self.consume is not None:
                tensors = self.consume(message.lifetime, tensors)
            args = tuple(t.detach().requires_grad_(True) if train and meta.requires_grad
                         else t for t, meta in zip(tensors, message.metas))
        if self.position in self.prepare_at and self.initializers:
            count = num_tokens(self.mb_inputs[mb] if self.mb_inputs is not None else args)
            for initializer in self.initializers:
                initializer.prepare(count, self.device)
        with torch.set_grad_enabled(train), self.data_parallel.forward(stage_index, train):
            output = stage(args, self.mb_kwargs[mb] if self.mb_kwargs is not None else None)
            if stage.is_last:
                self._finish(stage_index, mb, key, output)
            else:
                outs = as_outputs(output, stage_index, self.dtype)
                self.to_send[key] = outs
                if train:
                    self.outputs[key] = [t for t in outs if t.requires_grad]
                    if self.prepost_b and not stage.local_next:
                        self._post_recv_b(stage_index, key, -1)
                        self.preposted_b.add(key)
        if train and not stage.is_first:
            needs = [t for t in args if t.requires_grad]
            self.inputs[key] = needs
        elif train:
            self.inputs[key] = []

    def _finish(self, stage_index: int, mb: int, key: int, output) -> None:
        target = None if self.mb_targets is None else self.mb_targets[mb]
        if self.loss_fn is None or (target is None and not self.train):
            self.results[mb] = output.detach() if isinstance(output, torch.Tensor) else output
            return
        loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError(f"loss_fn returned {type(loss).__name__}"
                                f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
                                f"; it must return a scalar tensor (e.g. a mean over the batch)")
        self.losses[mb] = loss.detach().reshape(())
        if self.train:
            self.outputs[key] = [loss.reshape(()) * self.scale if self.scale != 1.0
                                 else loss.reshape(())]

    # ------------------------------------------------------------------ backward
    def _grads_for(self, stage: Stage, key: int):
        if stage.is_last:
            return None
        if stage.local_next:
            return self.grads_back.pop(key + self.num_microbatches)
        message = self.messages.pop(-1 - key, None)
        if message is None:
            return []
        tensors = self.mailbox.receive(message)
        if self.consume is not None:
            tensors = self.consume(message.lifetime, tensors)
        return tensors

    def _backward(self, action) -> None:
        stage_index, kind, mb = action
        stage = self.stages[stage_index]
        key = stage_index * self.num_microbatches + mb
        grads = self._grads_for(stage, key)
        outputs = self.outputs.pop(key)
        inputs = self.inputs.pop(key)
        with self.data_parallel.backward(stage_index, self.position, outputs):
            if kind is B:
                input_grads = backward_full(outputs, grads, inputs)
            else:
                input_grads, self.weight[key] = backward_input(outputs, grads, inputs)
        if not stage.is_first:
            self.grads_back[key] = input_grads

    def _weight(self, action) -> None:
        key = action.stage * self.num_microbatches + action.microbatch
        with self.data_parallel.backward(action.stage, self.position):
            backward_weight(self.weight.pop(key))

    # ------------------------------------------------------------------ communication
    def _send_f(self, action) -> None:
        stage_index = action.stage
        key = stage_index * self.num_microbatches + action.microbatch
        outs = self.to_send.pop(key)
        metas = [TensorMeta.of(t) for t in outs]
        header = None
        tensors = [t.detach().contiguous() for t in outs]
        peer = self.stages[stage_index].next_rank
        if not self.static_shapes:
            header = encode_header(metas)
            edge, mb = stage_index + 1, action.microbatch
            predicted = self.shapes_sent.predict(edge, mb)
            self.shapes_sent.record(edge, mb, metas)
            if predicted is not None:  # the receiver posted one packed buffer of these shapes
                if same_buffers(predicted, metas):
                    self.mailbox.send([pack(header, tensors, metas, self.device)], peer,
                                      TAG_PACKED)
                    return
                self.mailbox.send([pack(header, [None] * len(predicted), predicted,
                                        self.device)] + tensors, peer,
                                  (TAG_PACKED,) + (TAG_FIXUP,) * len(tensors))
                return
        else:
            known = self.sent_metas.get(stage_index)
            if known is None:
                self.sent_metas[stage_index] = metas
                header = encode_header(metas)
            elif known != metas:
                raise PipelineError(
                    f"stage {stage_index} output changed from {_describe(known)} to "
                    f"{_describe(metas)}, but pp_seq_len is set, which promises static shapes; "
                    f"unset pp_seq_len to let shapes vary, or pad inputs to pp_seq_len")
        self.mailbox.send(tensors, peer, TAG_FORWARD, header)

    def _recv_f(self, action) -> None:
        if self.position in self.preposted:
            return
        stage_index = action.stage
        key = stage_index * self.num_microbatches + action.microbatch
        peer = self.stages[stage_index].prev_rank
        lifetime = self.lifetime_at.get(self.position, -1)
        if not self.static_shapes:
            predicted = self.shapes_received.predict(stage_index, action.microbatch)
            message = Incoming(peer, TAG_FORWARD if predicted is None else TAG_PACKED, None,
                               lifetime, predicted)
            header = True
        else:
            header = stage_index not in self.recv_started
            self.recv_started.add(stage_index)
            message = Incoming(peer, TAG_FORWARD, self.recv_metas.get(stage_index), lifetime)
        message.edge = stage_index
        message.microbatch = action.microbatch
        self.messages[key] = self.mailbox.post(message, header)

    def _send_b(self, action) -> None:
        key = action.stage * self.num_microbatches + action.microbatch
        grads = self.grads_back.pop(key)
        if grads:
            tensors = [g.detach().contiguous() for g in grads]
            self.mailbox.send(tensors, self.stages[action.stage].prev_rank,
                              self._backward_tag(key - self.num_microbatches))

    def _backward_tag(self, key: int) -> int:
        """The tag of the gradient message for the outputs of ``key`` (stage * M + microbatch):
        on tag-matching backends one tag per message, so its receive may be posted at any time
        (``_forward`` posts it as soon as the outputs exist); NCCL ignores tags."""
        return TAG_BACKWARD if self.mailbox.ordered else _FIRST_BACKWARD_TAG + key

    def _recv_b(self, action) -> None:
        key = action.stage * self.num_microbatches + action.microbatch
        if key in self.preposted_b:
            self.preposted_b.discard(key)
            return
        self._post_recv_b(action.stage, key, self.lifetime_at.get(self.position, -1))

    def _post_recv_b(self, stage_index: int, key: int, lifetime: int) -> None:
        outputs = self.outputs.get(key)
        if not outputs:
            return
        metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in outputs]
        message = Incoming(self.stages[stage_index].next_rank, self._backward_tag(key), metas,
                           lifetime)
        self.messages[-1 - key] = self.mailbox.post(message, False)


_HANDLERS = {F: Executor._forward, B: Executor._backward, I: Executor._backward,
             W: Executor._weight, SEND_F: Executor._send_f, RECV_F: Executor._recv_f,
             SEND_B: Executor._send_b, RECV_B: Executor._recv_b}


class _ReceivedShapes:
    """Tensor metas the receiving side learned from headers, per edge (the receiving stage):
    with static shapes the first header's metas, else the :class:`ShapeHistory` of every one."""

    def __init__(self, static_shapes: bool):
        self.static_shapes = static_shapes
        self.metas: dict[int, list] = {}
        self.history = ShapeHistory()

    def edge_metas(self, message: Incoming) -> list:
        return self.metas[message.edge]

    def has_edge_metas(self, message: Incoming) -> bool:
        return message.edge in self.metas

    def header_decoded(self, message: Incoming) -> None:
        if self.static_shapes:
            self.metas.setdefault(message.edge, message.metas)
        else:
            self.history.record(message.edge, message.microbatch, message.metas)


def _describe(metas) -> str:
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}"
                           for m in metas) + "]"
