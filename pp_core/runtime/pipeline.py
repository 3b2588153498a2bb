""":class:`Pipeline`: a model split over ranks, run by a lowered schedule.

:func:`~pp_core.runtime.build.build_pipeline` plans and builds it (before any pipeline traffic);
:meth:`Pipeline.step` then runs one training step.

What ``step`` returns: on the rank holding the last stage, the mean of the microbatch losses as a
detached 0-dim float32 tensor on ``device`` (a tensor, so that CUDA need not synchronise; call
``.item()`` for a float); ``None`` elsewhere. Gradients are *accumulated* into ``.grad`` like
``loss.backward()`` does (zero them between steps): the gradient of the sum of the microbatch
losses, or of their mean when ``scale_grads_in_schedule=True``. With a token-normalised loss
(``cross_entropy``; :mod:`pp_core.runtime.token_loss`) that mean is the loss of the whole step
over its valid target tokens: the unsplit model's loss on the batch (with ``meshes`` at dp > 1,
the mean over the dp ranks' returns is the global batch's loss).

Failures: any exception during a step - on any rank - ends the step on every rank with a
:class:`~pp_core.PipelineError` naming the rank, stage, action and cause (see
:mod:`pp_core.runtime.p2p`); the process group is destroyed in the process (its point-to-point
state is undefined after a partial step, as with NCCL's abort), so build a new group and pipeline
to continue. Each wait is bounded by ``timeout`` seconds (default: ``$PP_CORE_TIMEOUT``, else the
process group's timeout).
"""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

import torch
from torch import nn

from pp_core.config import PipelineConfig
from pp_core.errors import ConfigError, PipelineError, PPCoreError
from pp_core.losses import counts_tokens, resolve_loss
from pp_core.parallel.compose import after_step
from pp_core.parallel.tied import grad_baseline, sync_tied_gradients_of
from pp_core.plugin_manager import plugins_or_default
from pp_core.runtime.frozen import check_frozen, mark_frozen
from pp_core.runtime.agreement.calls import CallAgreement
from pp_core.runtime.allocator import make_recv_buffer_allocator
from pp_core.runtime.p2p import P2P, PeerFailure
from pp_core.runtime.dp_sync import make_data_parallel
from pp_core.runtime.executor import Executor
from pp_core.runtime.failures import end_failed_step, forget_frames
from pp_core.runtime.group import resolve_group, resolve_timeout
from pp_core.runtime.initializers import collect_pipeline_runtime_initializers
from pp_core.runtime.microbatch import (kwargs_chunk_dims, merge_microbatches,
                                        split_microbatches, to_device)
from pp_core.runtime.observers import ActionTrace
from pp_core.runtime.saved_bytes import SavedBytes
from pp_core.runtime.seq_slices import cut_units, join_sequence, shift_labels, sliced_loss
from pp_core.runtime.stage import Stage
from pp_core.runtime.token_loss import resolve_dp_group, step_token_count
from pp_core.schedule.ir import Schedule
from pp_core.schedule.lower import Program, forward_only, lower
from pp_core.schedule.validate import validate_schedule

__all__ = ["Pipeline"]

_pipeline_ids = itertools.count()


def _check_parts(schedule: Schedule, rank: int, num_ranks: int, stage_indices, parts) -> None:
    """The parts given are the stages the schedule places on this rank of this group."""
    if schedule.num_ranks != num_ranks:
        raise ConfigError(f"the schedule has {schedule.num_ranks} ranks but the process group "
                          f"has {num_ranks}; build the schedule for num_ranks={num_ranks}")
    expected = schedule.stages_of(rank)
    if tuple(stage_indices) != expected:
        raise ConfigError(f"rank {rank} holds stages {expected} in schedule "
                          f"{schedule.name!r}, but stage_indices={tuple(stage_indices)}")
    if len(parts) != len(expected):
        raise ConfigError(f"rank {rank} holds {len(expected)} stages but got "
                          f"{len(parts)} model parts")


class Pipeline:
    """This rank's stages of a pipelined model, and the programs that train and evaluate it.

    Build it with :func:`build_pipeline`; the constructor takes ready-made parts (one per stage
    this rank holds, in stage order) for callers that split the model themselves.
    """

    def __init__(self, model_parts: Sequence[nn.Module], stage_indices: Sequence[int],
                 schedule: Schedule, config: PipelineConfig, pp_group=None, device="cpu", *,
                 program: Optional[Program] = None, plugins=None, timeout=None,
                 initializers=None, plan=None, meshes=None):
        group, rank, num_ranks = resolve_group(meshes.pp if pp_group is None and meshes else
                                               pp_group)
        _check_parts(schedule, rank, num_ranks, stage_indices, model_parts)
        plugins = plugins_or_default(plugins)
        self.config = config
        self._calls = CallAgreement(group, num_ranks, device)  # step vs eval_step, every call
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = torch.device(device)
        self.dtype = config.torch_dtype
        self.schedule = schedule
        self.plan = plan
        """The :class:`~pp_core.planning.plan.PipelinePlan` it was built from (``None`` when it
        was given ready-made parts)."""
        if program is None:  # a schedule made by hand: check it as build_schedule would
            validate_schedule(schedule)
            program = lower(schedule)
        self.program = program
        self.stage_indices = tuple(stage_indices)
        # config.dtype is the dtype of the tensors stages send and receive (NeMo's meaning):
        # parameters keep the model's dtype, the optimizer's precision is never changed here
        self.model_parts = [part.to(self.device) for part in model_parts]
        # the model's get_pipeline_kwargs_chunk_dims (NeMo), asked on every rank alike: each
        # part keeps the model's class (microbatch.kwargs_chunk_dims)
        self._chunk_dims_of = self.model_parts[0]
        self.num_stages = schedule.num_stages
        self.num_microbatches = schedule.num_sequences
        self.seq_chunks = schedule.seq_chunks
        """Sequence slices per microbatch: the schedule's units (:mod:`~.seq_slices`)."""
        if self.num_microbatches != config.num_microbatches:
            raise ConfigError(
                f"the schedule runs {self.num_microbatches} microbatches but pp_batch_size="
                f"{config.pp_batch_size} / pp_microbatch_size={config.pp_microbatch_size} gives "
                f"{config.num_microbatches}")
        self.loss_fn = None if config.loss_fn is None else resolve_loss(config.loss_fn)
        self.counts_tokens = self.loss_fn is not None and counts_tokens(self.loss_fn)
        """Whether the loss is token-normalised over the step (:mod:`~.token_loss`)."""
        self.loss_fn, self._shift_targets = sliced_loss(model_parts, self.loss_fn,
                                                        self.counts_tokens, self.seq_chunks)
        self.meshes = meshes
        """The run's :class:`~pp_core.parallel.dims.Meshes` (``None``: pipeline only): the loss
        counts tokens over ``meshes.loss_group``; ``step`` ends with
        :func:`~pp_core.parallel.compose.after_step` over them."""
        self.dp_group, self.dp_size = resolve_dp_group(None if meshes is None else
                                                       meshes.loss_group)
        if initializers is None:
            initializers = collect_pipeline_runtime_initializers(self.model_parts, plugins)
        self.initializers = list(initializers)
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices
        self.stages = {index: Stage(index, part, schedule.stage_ranks, rank)
                       for index, part in zip(self.stage_indices, self.model_parts)}
        mark_frozen(self.stages, None if plan is None else plan.trainable)  # the program's flags
        group_name = getattr(group, "group_name", "local") if group is not None else "local"
        self.p2p = P2P(group, self.device, resolve_timeout(timeout), f"{group_name}/{next(_pipeline_ids)}",
                       rank)
        self._observers: list = []  # shared by both executors (add_action_observer)
        rank_program = self.program.rank(rank)
        self.allocator = make_recv_buffer_allocator(plugins, config, rank_program, rank,
                                                    self.device)
        self._train = Executor(rank_program, self.stages, self.p2p, self.allocator, train=True,
                               loss_fn=self.loss_fn, scale=1.0 / self.num_microbatches
                               if config.scale_grads_in_schedule else 1.0,
                               initializers=self.initializers, device=self.device,
                               dtype=self.dtype, static_shapes=config.pp_seq_len is not None,
                               observers=self._observers,
                               send_acks=self.program.send_acks(rank))
        self._eval: Optional[Executor] = None
        self.saved_bytes = SavedBytes()
        """``saved_bytes.peak``: the most bytes autograd held saved at once on this rank during
        the last training step (:mod:`~.saved_bytes`)."""
        self._plugins = plugins
        self.tracing = False
        """Record every action's start and end (see :mod:`pp_core.runtime.tracing`)."""
        self.last_trace: Optional[list] = None
        """``[(action, start, end), ...]`` of the last traced step, wall-clock seconds."""

    @property
    def plugins(self):
        """The :class:`~pp_core.plugins.Plugins` this pipeline was built with."""
        return self._plugins

    @property
    def group(self):
        """The pipeline's process group (``None`` for one process, or after a failure)."""
        return self.p2p.group

    # ------------------------------------------------------------------ public
    def add_action_observer(self, observer) -> None:
        """Call ``observer`` around every action of every later step on this rank (training and
        evaluation): an :class:`~pp_core.runtime.observers.ActionObserver`."""
        self._observers.append(observer)

    def remove_action_observer(self, observer) -> None:
        """Stop calling ``observer`` (registered with :meth:`add_action_observer`)."""
        self._observers.remove(observer)

    def step(self, inputs=None, target=None, *, stage_kwargs: Optional[dict] = None):
        """One training step over ``pp_batch_size`` samples; the same call on every rank.

        ``inputs`` are needed on the rank holding the first stage and ``target`` on the rank
        holding the last one; both may be passed on every rank (SPMD style) and are used only
        where needed. ``stage_kwargs`` (a dict, split into microbatches like ``inputs``) are
        keyword arguments of *every* stage's forward, e.g. ``{"position_ids": ids}``; pass them
        on every rank. Returns the mean microbatch loss on the last stage's rank, else ``None``.
        """
        self._check_usable()
        self._calls.check("step", self.model_parts, self.p2p.timeout)
        if self.loss_fn is None:
            self._fail(ConfigError("step() trains, which needs a loss: set PipelineConfig.loss_fn "
                                   "(a callable, 'cross_entropy', or 'module:attr'), or call "
                                   "eval_step() for a forward pass"), before_traffic=True)
        self._sync_parts(train=True)

        def run():
            baseline = grad_baseline(self.model_parts)  # weights several stages hold
            params = [p for part in self.model_parts for p in part.parameters()]
            with self.saved_bytes.measuring(params):
                losses, _ = self._run(self._train, inputs, target, need_target=True,
                                      stage_kwargs=stage_kwargs)
            after_step(self.model_parts, self.meshes)  # TP's partial sums, EP's experts
            if baseline:  # their gradients summed over the ranks holding them
                sync_tied_gradients_of(self.model_parts, self.schedule.stage_ranks, self.rank,
                                       self.group, baseline)
            return self._mean_loss(losses) if self.has_last else None

        # plugins' pp_pipeline_step wrappers run around it
        try:
            return self._plugins.run_step(self, True, run)
        except BaseException as exc:
            forget_frames(exc)
            raise

    def eval_step(self, inputs=None, target=None, *, stage_kwargs: Optional[dict] = None):
        """Forward only, without gradients. On the last stage's rank returns the mean microbatch
        loss when ``target`` is given (and a loss_fn is set), else the last stage's outputs
        concatenated along dim 0; ``None`` on other ranks."""
        self._check_usable()
        self._calls.check("eval_step", self.model_parts, self.p2p.timeout)
        self._sync_parts(train=False)
        if self._eval is None:
            program = lower(forward_only(self.schedule)).rank(self.rank)
            allocator = make_recv_buffer_allocator(self._plugins, self.config, program, self.rank,
                                                   self.device)
            self._eval = Executor(program, self.stages, self.p2p, allocator, train=False,
                                  loss_fn=self.loss_fn, initializers=self.initializers,
                                  device=self.device, dtype=self.dtype,
                                  static_shapes=self.config.pp_seq_len is not None,
                                  observers=self._observers)

        def run():
            losses, outputs = self._run(self._eval, inputs, target, need_target=False,
                                        stage_kwargs=stage_kwargs)
            if not self.has_last:
                return None
            if losses:
                return self._mean_loss(losses)
            if self.seq_chunks > 1:
                outputs = join_sequence(outputs, self.seq_chunks)
            return merge_microbatches(outputs)

        try:
            return self._plugins.run_step(self, False, run)
        except BaseException as exc:
            forget_frames(exc)
            raise

    # ------------------------------------------------------------------ internals
    def _mean_loss(self, losses: list) -> torch.Tensor:
        """The mean microbatch loss; with slices a microbatch's loss is its slices' sum."""
        if self.seq_chunks == 1:
            return torch.stack(losses).float().mean()
        return torch.stack(losses).float().sum() / self.num_microbatches

    def _sync_parts(self, train: bool) -> None:
        """Stages run what ``model_parts`` holds now (a part may have been replaced by its DDP
        wrapper); a training step drives the parts' torch DP engines (:mod:`~.dp_sync`)."""
        for index, part in zip(self.stage_indices, self.model_parts):
            self.stages[index].module = part
        if train:
            try:
                check_frozen(self.stages)
                self._train.data_parallel = make_data_parallel(self.stages, self.config,
                                                               self._train.program.actions)
            except PPCoreError as exc:
                self._fail(exc, before_traffic=True)

    def _check_usable(self) -> None:
        if self.p2p.broken is not None:
            raise PipelineError(f"this pipeline stopped after a failure ({self.p2p.broken}); "
                                f"create a new process group and pipeline to continue")

    def _split(self, value, what: str) -> list:
        dims = {} if what == "target" else kwargs_chunk_dims(self._chunk_dims_of, value)
        if what == "target" and self._shift_targets:
            value = shift_labels(value)
        parts = cut_units(split_microbatches(value, self.num_microbatches,
                                             self.config.pp_batch_size, what, dims),
                          self.seq_chunks, what)
        return [to_device(part, self.device, self.dtype if what != "target" else None)
                for part in parts]

    def _prepare(self, inputs, target, need_target: bool):
        if inputs is None and self.has_first:
            raise ConfigError(f"rank {self.rank} holds stage 0 but step() got no inputs; pass the "
                              f"step's batch (pp_batch_size={self.config.pp_batch_size}) here")
        mb_inputs = None if inputs is None else self._split(inputs, "inputs")
        mb_targets = None
        if self.has_last and self.loss_fn is not None:
            if target is None and need_target:
                raise ConfigError(
                    f"rank {self.rank} holds the last stage ({self.num_stages - 1}), whose "
                    f"loss_fn(output, target) needs a target, but step() got target=None; pass "
                    f"target=... (it may be passed on every rank)")
        if target is not None:
            mb_targets = self._split(target, "target")
        return mb_inputs, mb_targets

    def _run(self, executor: Executor, inputs, target, need_target: bool, stage_kwargs=None):
        try:
            mb_inputs, mb_targets = self._prepare(inputs, target, need_target)
            mb_kwargs = None
            if stage_kwargs is not None:
                if not isinstance(stage_kwargs, dict):
                    raise ConfigError(f"stage_kwargs must be a dict of keyword arguments, got "
                                      f"{type(stage_kwargs).__name__}")
                mb_kwargs = self._split(stage_kwargs, "stage_kwargs")
            tokens = {}  # a token-normalised loss: the step's count, once
            if self.counts_tokens and self.has_last and mb_targets is not None:
                tokens = dict(token_count=step_token_count(self.loss_fn, mb_targets,
                                                           self.dp_group, self.device),
                              token_factor=float(self.num_microbatches * self.dp_size))
        except PPCoreError as exc:
            self._fail(exc, before_traffic=True)
        tracer = ActionTrace() if self.tracing else None
        if tracer is not None:
            executor.observers.append(tracer)
        try:
            result = executor.run(mb_inputs, mb_targets, mb_kwargs, **tokens)
            if tracer is not None:
                offset = time.time() - time.perf_counter()
                self.last_trace = [(a, s + offset, e + offset) for a, s, e in tracer.events]
            failure = self.p2p.peer_failed()
            if failure is not None:
                raise PeerFailure(failure)
            return result
        except Exception as exc:
            end_failed_step(executor, self.p2p, self.rank, exc)
        finally:
            if tracer is not None:
                executor.observers.remove(tracer)

    def _fail(self, exc: Exception, before_traffic: bool):
        """A usage error found before any traffic: tell the peers (they may be waiting), raise."""
        if self.num_ranks > 1:
            self.p2p.publish_and_abort(f"rank {self.rank} refused the step: {exc}")
        raise exc

    def __repr__(self) -> str:
        return (f"Pipeline(rank={self.rank}/{self.num_ranks}, stages={self.stage_indices}, "
                f"schedule={self.schedule.name!r}, microbatches={self.num_microbatches})")
