"""The executor: runs this rank's lowered program, one action after the other, and nothing else.

The program (see :mod:`pp_core.schedule.lower`) decides what runs and in which order; the
executor only knows how to run each kind of action:

* ``RECV_F``/``RECV_B`` post the receive of a message (:class:`~pp_core.runtime.mailbox.Mailbox`);
* ``F`` takes its inputs (the microbatch on the first stage, a received message, or the output
  of the previous stage when it lives on this rank), runs the stage, and on the last stage the
  loss; before the first forward of each microbatch on this rank it prepares the runtime
  initializers;
* ``B`` is the full backward, ``I``/``W`` the split one (:mod:`pp_core.runtime.backward`); the
  gradients of the stage inputs go to ``SEND_B`` or, on this rank, to the previous stage;
* ``SEND_F``/``SEND_B`` post the send of what the preceding compute produced
  (the communication handlers live in :mod:`pp_core.runtime.transfers`).

Every handler gets the step's :class:`~pp_core.runtime.step_state.StepState`, made by
:meth:`Executor.run` for each step; a failed step ends by clearing it (:meth:`Executor.abort`).

Observers registered with ``Pipeline.add_action_observer`` are called around every action, and
every action runs in a ``torch.profiler`` record while a profiler records
(:mod:`pp_core.runtime.observers`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from pp_core._torch_compat import profiler_enabled
from pp_core.errors import PipelineError
from pp_core.parallel.expert.aux_loss import aux_loss_modules, scale_aux_losses
from pp_core.runtime import transfers
from pp_core.runtime.backward import backward_full, backward_input, backward_weight
from pp_core.runtime.mailbox import Incoming, Mailbox
from pp_core.runtime.p2p import P2P
from pp_core.runtime.seq_slices import SeqSlice, backward_roots, running
from pp_core.runtime.dp_sync import DataParallelDriver
from pp_core.runtime.microbatch import num_tokens
from pp_core.runtime.observers import run_action, waiting
from pp_core.runtime.stage import Stage, as_dtensors, as_outputs, local_outputs, make_stage_inputs
from pp_core.runtime.step_state import StepState
from pp_core.runtime.token_loss import scaled_loss
from pp_core.runtime.transfers import BoundaryShapes, TransferContext
from pp_core.runtime.wire import ReceivedShapes
from pp_core.schedule.ir import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W
from pp_core.schedule.lower import RankProgram

__all__ = ["Executor"]


class Executor:
    """Runs one rank's program for one step (training) or one forward pass (evaluation).

    What one step makes lives in its :class:`~pp_core.runtime.step_state.StepState` (``state``:
    the running step's, or the last one's once it finished); what the SEND/RECV handlers need
    besides it is the fixed :class:`~pp_core.runtime.transfers.TransferContext` (``context``).
    """

    def __init__(self, program: RankProgram, stages: dict[int, Stage], p2p: P2P, allocator, *,
                 train: bool, loss_fn=None, scale: float = 1.0, initializers=(),
                 device: torch.device, dtype=None, static_shapes: bool = False,
                 observers: Optional[list] = None, send_acks: Optional[dict] = None):
        self.program = program
        # where this rank's sends are known received (Program.send_acks): waited there, so
        # the tensors they hold go then and not at the step's end (gloo cannot poll a send)
        self.send_acks = send_acks or {}
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
        # what receivers learn from headers; the mailbox reports to it (not to the executor,
        # which owns the mailbox: a reference cycle would keep the model alive after del)
        shapes = BoundaryShapes(ReceivedShapes(static_shapes))
        self.mailbox = Mailbox(p2p, allocator, device, shapes.received)
        # shared with the pipeline, which adds and removes observers (pp_core.runtime.observers)
        self.observers: list = observers if observers is not None else []
        self.num_microbatches = program.num_microbatches
        self.seq_chunks = getattr(program, "seq_chunks", 1)  # units are slices when > 1
        actions = program.actions
        self.context = TransferContext(
            rank=self.rank, stages=stages, mailbox=self.mailbox,
            num_microbatches=self.num_microbatches, static_shapes=static_shapes, device=device,
            actions=actions, shapes=shapes,
            lifetime_at={lt.posted: index for index, lt in enumerate(program.recv_lifetimes)})
        self.release_at: dict[int, list[int]] = {}
        for index, lt in enumerate(program.recv_lifetimes):
            self.release_at.setdefault(lt.released, []).append(index)
        seen, self.prepare_at = set(), set()
        for position, action in enumerate(actions):
            if action.kind is F and action.microbatch not in seen:
                seen.add(action.microbatch)
                self.prepare_at.add(position)
        # an allocator that hands buffers out again must get them back when the program says
        # (pp_core.runtime.buffers: ``reuses_buffers``, True unless it says otherwise)
        self.track_release = bool(getattr(allocator, "reuses_buffers", True))
        self.consume = getattr(allocator, "consume", None)
        self.data_parallel = DataParallelDriver()  # torch DP engines of the stages (dp_sync)
        self.state: Optional[StepState] = None
        self._aux_modules: Optional[list] = None  # layers with auxiliary losses, found once

    @property
    def current(self):
        """The action being run, for error messages (``None`` between actions)."""
        return None if self.state is None else self.state.current

    # ------------------------------------------------------------------ step
    def run(self, mb_inputs: Optional[list], mb_targets: Optional[list],
            mb_kwargs: Optional[list] = None, *, token_count=None, token_factor: float = 1.0):
        """Run the program once. Returns ``(losses, outputs)`` (lists by microbatch; empty when
        this rank does not hold the last stage). ``mb_kwargs``: per microbatch, keyword inputs
        for every stage. ``token_count`` / ``token_factor``: a token-normalised loss's valid
        tokens of the step and M * D (:mod:`pp_core.runtime.token_loss`)."""
        mailbox, context = self.mailbox, self.context
        # post receives before their RECV where the backend matches by tag and buffers do not
        # follow the program's lifetimes (docs/runtime.md, The executor)
        self.state = state = StepState(
            self.num_microbatches, mb_inputs, mb_targets, mb_kwargs, token_count, token_factor,
            early_receives=not mailbox.ordered and not self.track_release,
            aux_loss_scale=self.scale)
        context.shapes.sent.new_step()
        context.shapes.received.history.new_step()
        handlers = _HANDLERS
        if state.early_receives:
            transfers.prepost_forward(context, state)
        self.data_parallel.begin_step()
        if self.train:  # layers injecting an auxiliary loss's gradient scale it as the loss
            if self._aux_modules is None:
                self._aux_modules = aux_loss_modules(s.module for s in self.stages.values())
            scale_aux_losses(self._aux_modules, state.aux_loss_scale)
        release_at, send_acks = self.release_at, self.send_acks
        observers, profiled = self.observers, profiler_enabled()  # once per step: cheap
        plain = not observers and not profiled
        for position, action in enumerate(self.program.actions):
            state.current = action
            state.position = mailbox.origin = position
            if plain:
                handlers[action.kind](self, state, action)
            else:
                run_action(handlers[action.kind], self, state, action, observers, profiled)
            if position in send_acks:
                mailbox.settle(send_acks[position])
            if mailbox.unflushed and not mailbox.ordered:
                mailbox.poll()
            if position in release_at and self.track_release:
                issued = mailbox.sends_issued
                state.pending_release += [(issued, index) for index in release_at[position]]
                self._release(state, blocking=False)
        state.current = None
        waiting(observers, None, mailbox.wait_sends)
        self._release(state, blocking=True)
        reset = getattr(self.allocator, "reset", None)
        if reset is not None:
            reset()
        leftovers = state.leftovers()
        if leftovers:
            raise PipelineError(f"rank {self.rank}: the program left work undone ({leftovers}); "
                                f"the schedule is incomplete - run validate_schedule() on it")
        return state.finish()

    def _release(self, state: StepState, blocking: bool) -> None:
        mailbox = self.mailbox
        mailbox.reap()
        keep = []
        for issued, index in state.pending_release:
            if blocking or issued <= mailbox.sends_done:
                self.allocator.release(index)
            else:
                keep.append((issued, index))
        state.pending_release = keep

    def abort(self) -> None:
        """Drop every tensor and pending operation of a failed step."""
        if self.state is not None:
            self.state.clear()
            self.state = None
        self.mailbox.clear()
        self.data_parallel.abort()
        reset = getattr(self.allocator, "reset", None)
        if reset is not None:
            try:
                reset()
            except Exception:
                pass

    # ------------------------------------------------------------------ forward
    def _forward(self, state: StepState, action) -> None:
        stage_index, _, mb = action
        stage = self.stages[stage_index]
        M = self.num_microbatches
        key = stage_index * M + mb
        train = self.train
        if stage.is_first:
            if state.mb_inputs is None:
                raise PipelineError("the first stage needs the step's inputs on this rank")
            args = state.mb_inputs[mb]
        elif stage.local_prev:
            args = make_stage_inputs(state.to_send.pop(key - M), train and stage.input_grads)
            placements = state.layouts.pop(key - M, None)
        else:
            message = state.messages.pop(key)
            tensors = self._receive(state, message)
            if self.consume is not None:
                tensors = self.consume(message.lifetime, tensors)
            grads = train and stage.input_grads
            args = tuple(t.detach().requires_grad_(True) if grads and meta.requires_grad
                         else t for t, meta in zip(tensors, message.metas))
            placements = [meta.placements for meta in message.metas]
        if state.position in self.prepare_at and self.initializers:
            count = num_tokens(state.mb_inputs[mb] if state.mb_inputs is not None else args)
            for initializer in self.initializers:
                initializer.prepare(num_tokens=count, device=self.device)
        mb_kwargs = state.mb_kwargs
        train = train and stage.runs_backward  # a frozen prefix keeps no autograd graph
        piece = self._slice(state, stage_index, mb)
        with torch.set_grad_enabled(train), self.data_parallel.forward(stage_index, train), \
                running(piece) if piece is not None else _NO_SLICE:
            call_args = args if stage.is_first else as_dtensors(stage, args, placements)
            output = stage(call_args, mb_kwargs[mb] if mb_kwargs is not None else None)
            if piece is not None and piece.kept:
                state.slice_kept[key] = piece.kept
            if piece is not None and piece.read and train:
                state.slice_read[key] = piece.read
            if stage.is_last:
                self._finish(state, mb, key, output)
            else:  # DTensors travel as local shards, their placements alongside
                outs, layouts = local_outputs(as_outputs(output, stage_index, self.dtype))
                state.to_send[key] = outs
                if layouts is not None:
                    state.layouts[key] = layouts
                if train:
                    state.outputs[key] = [t for t in outs if t.requires_grad]
                    if state.early_receives and not stage.local_next:
                        transfers.post_recv_backward(self.context, state, stage_index, key, -1)
                        state.preposted_b.add(key)
        if train and not stage.is_first:
            needs = [t for t in args if t.requires_grad]
            state.inputs[key] = needs
        elif train:
            state.inputs[key] = []

    def _slice(self, state: StepState, stage_index: int, unit: int) -> Optional[SeqSlice]:
        """The :class:`SeqSlice` of this unit's forward (``None`` without slices); the prefix
        caches of its microbatch go after its last slice (:mod:`pp_core.runtime.seq_slices`)."""
        K = self.seq_chunks
        if K == 1:
            return None
        microbatch, index = divmod(unit, K)
        where = (stage_index, microbatch)
        store = state.slice_store.pop(where) if index == K - 1 else \
            state.slice_store.setdefault(where, {})
        return SeqSlice(index, K, store)

    def _finish(self, state: StepState, mb: int, key: int, output) -> None:
        target = None if state.mb_targets is None else state.mb_targets[mb]
        if self.loss_fn is None or (target is None and not self.train):
            state.results[mb] = output.detach() if isinstance(output, torch.Tensor) else output
            return
        loss = scaled_loss(self.loss_fn, output, target, state.token_count, state.token_factor)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineError(f"loss_fn returned {type(loss).__name__}"
                                f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
                                f"; it must return a scalar tensor (e.g. a mean over the batch)")
        state.losses[mb] = loss.detach().reshape(())
        if self.train and self.stages[key // self.num_microbatches].runs_backward:
            state.outputs[key] = [loss.reshape(()) * self.scale if self.scale != 1.0
                                  else loss.reshape(())]

    # ------------------------------------------------------------------ backward
    def _grads_for(self, state: StepState, stage: Stage, key: int):
        if stage.is_last:
            return None
        if stage.local_next:
            return state.grads_back.pop(key + self.num_microbatches)
        message = state.messages.pop(-1 - key, None)
        if message is None:
            return []
        tensors = self._receive(state, message)
        if self.consume is not None:
            tensors = self.consume(message.lifetime, tensors)
        return tensors

    def _receive(self, state: StepState, message: Incoming) -> list:
        """Wait for a message the current action consumes (the observers see the wait)."""
        if not self.observers:
            return self.mailbox.receive(message)
        return waiting(self.observers, state.current, self.mailbox.receive, message)

    def _backward(self, state: StepState, action) -> None:
        stage_index, kind, mb = action
        stage = self.stages[stage_index]
        key = stage_index * self.num_microbatches + mb
        grads = self._grads_for(state, stage, key)
        outputs = state.outputs.pop(key)
        inputs = state.inputs.pop(key)
        read = ()
        if self.seq_chunks > 1:  # slices: K/V gradients of later slices in, of earlier ones out
            outputs, grads = backward_roots(outputs, grads, state.slice_kept.pop(key, ()))
            read = state.slice_read.pop(key, ())
            held = [leaf.grad for leaf in read]
            for leaf in read:
                leaf.grad = None
            inputs = list(inputs) + list(read)
        with self.data_parallel.backward(stage_index, state.position, outputs):
            if kind is B:
                input_grads = backward_full(outputs, grads, inputs)
            else:  # with slices the earlier slices' key/value leaves are inputs of I
                input_grads, state.weight[key] = backward_input(outputs, grads, inputs)
        if read:
            input_grads, made = input_grads[:-len(read)], input_grads[-len(read):]
            for leaf, before, grad in zip(read, held, made):
                leaf.grad = grad if before is None else before + grad
        if stage.input_grads:
            state.grads_back[key] = input_grads

    def _weight(self, state: StepState, action) -> None:
        key = action.stage * self.num_microbatches + action.microbatch
        with self.data_parallel.backward(action.stage, state.position):
            backward_weight(state.weight.pop(key))


_NO_SLICE = contextlib.nullcontext()


def _on_context(handler):
    """A SEND/RECV handler, called as the compute ones are: with the executor's context."""
    def run(executor: Executor, state: StepState, action) -> None:
        handler(executor.context, state, action)
    run.__name__ = handler.__name__
    return run


# plain functions, called as handler(executor, state, action): bound methods stored on the
# executor would make a reference cycle that keeps the model alive after ``del pipe``
_HANDLERS = {F: Executor._forward, B: Executor._backward, I: Executor._backward,
             W: Executor._weight, SEND_F: _on_context(transfers.send_forward),
             RECV_F: _on_context(transfers.recv_forward),
             SEND_B: _on_context(transfers.send_backward),
             RECV_B: _on_context(transfers.recv_backward)}
