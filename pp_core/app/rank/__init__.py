"""The training loop every rank of ``pp-core run`` executes.

One rank's life: join the process group, lay the ranks out as one device mesh
``(pp, dp_replicate, dp_shard, tp)`` with the expert-parallel groups drawn from its dp ranks
(:meth:`pp_core.parallel.dims.ParallelDims.build`),
build the whole model with the run's seed (so every rank starts from the same weights, whatever
the layout), cut out this rank's stages with :func:`pp_core.build_pipeline` over the mesh's pp
group, apply the other parallelisms to them in their one order (:func:`pp_core.parallel.parallelize`:
TP, EP, activation checkpointing, compile, then torch's data parallelism; ``Pipeline.step``
finishes their gradients once per step), then for each step: take this dp rank's slice of the global batch, run the pipeline step,
clip, step the optimizers, and report. Checkpoints, evaluation, metrics, the trace and the summary hang off the
loop; the first rank draws the progress line.

The numbers are those of one process training the unsplit model on the global batch with
gradient accumulation: the reported loss is the mean microbatch loss over the global batch and the
gradient is the gradient of that mean. With a token-normalised loss (``cross_entropy``, HF's
``causal_lm_loss``; docs/data.md) that mean is the global batch's loss over its valid target
tokens, exactly, however they fall into microbatches and dp ranks.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pp_core import build_pipeline
from pp_core.app.rank.data_metrics import batch_figures
from pp_core.app.factories import build_dataset, build_model, dp_slice
from pp_core.app.rank.health import apply_update
from pp_core.app.machine import MachineShare
from pp_core.app.rank.progress import Progress, phase
from pp_core.app.rank.saving import Checkpoints
from pp_core.app.rank.run_outputs import RunRecorder
from pp_core.app.restarts import Attempts, join_group, resume_setting
from pp_core.app.spec import Spec
from pp_core.app.spec.sections import TrainSpec
from pp_core.errors import PipelineError
from pp_core.losses import pop_aux_losses
from pp_core.parallel.compose import ParallelSettings, parallelize
from pp_core.parallel.gradients import clip_grad_norm, finish_gradients, tied_copies
from pp_core.runtime.microbatch import kwargs_chunk_dims, num_tokens

__all__ = ["train", "lr_factor", "RankContext"]


def lr_factor(step: int, train: TrainSpec) -> float:
    """Learning-rate multiplier for ``step`` (1-based): linear warm-up, then constant/linear/cosine."""
    warmup, total = train.warmup_steps, train.steps
    if warmup and step <= warmup:
        return step / warmup
    if train.lr_decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    floor = train.min_lr_ratio
    if train.lr_decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class RankContext:
    """Process group, meshes and device of this rank: ``rank``, ``world_size``, ``device``,
    ``dims`` (the spec's :class:`~pp_core.parallel.dims.ParallelDims`) and what its ``build``
    made (``meshes``: read ``ctx.meshes.pp_rank``, ``ctx.meshes.dp``, ...)."""

    def __init__(self, spec: Spec):
        share = MachineShare.of(spec)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if share.device == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(share.threads_per_rank)  # cores shared out
        if not dist.is_initialized():
            join_group(share.backend, timedelta(seconds=spec.distributed.timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dims = dims = spec.dims
        mismatch = dims.world_size_problem(self.world_size)
        if mismatch:
            raise PipelineError(mismatch)
        self.meshes = dims.build(share.device)  # every mesh and group, in one place


def _build(spec: Spec, ctx: RankContext):
    """Model (seeded, whole, then split), pipeline, one optimizer per model part."""
    model = build_model(spec)
    num_params = sum(p.numel() for p in model.parameters())
    # the whole model, as every rank builds it: the same answer everywhere, no collective
    aux_losses = any(isinstance(getattr(m, "pp_aux_losses", None), list) for m in model.modules())
    checkpointing = activation_checkpointing_of(spec, model)
    # each wait is bounded by distributed.timeout_s (so a stuck peer's message says how long),
    # unless $PP_CORE_TIMEOUT sets it for every pipeline
    timeout = None if os.environ.get("PP_CORE_TIMEOUT") else spec.distributed.timeout_s
    splitter = spec.model.splitter  # `balanced` was resolved into module lists at launch
    if spec.pipeline.module_fqns_per_model_part is not None:
        splitter = None
    pipe = build_pipeline(model, spec.pipeline, device=ctx.device, meshes=ctx.meshes,
                          timeout=timeout, splitter=splitter)
    del model
    dp_units = parallelize(pipe, ctx.meshes, parallel_settings(spec, checkpointing)) \
        .data_parallel_units
    options = dict(spec.train.optimizer)
    cls = getattr(torch.optim, options.pop("name"))
    owned = _distinct_parameters(pipe.model_parts)  # a weight two local parts share: stepped once
    optimizers = [cls(params, **options) if params else None for params in owned]
    return pipe, optimizers, num_params, dp_units, aux_losses


def _distinct_parameters(parts) -> list[list]:
    """Each part's trainable parameters, less those an earlier part of this rank already holds
    (a module several stages share: module_fqns_per_model_part naming it in several parts).
    Frozen parameters (model.freeze, model.lora's base) get no optimizer state."""
    seen: set[int] = set()
    owned = []
    for part in parts:
        mine = [p for p in part.parameters() if id(p) not in seen and p.requires_grad]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


def activation_checkpointing_of(spec: Spec, model) -> dict:
    """``train.activation_checkpointing``, with a Hugging Face model's own switch folded in.

    ``model.gradient_checkpointing_enable()`` (or a config that turns it on) asks for the same
    thing as ``mode: full``; HF's own wrapper is turned off so that one mechanism, pp-core's
    (one recompute per block with split backward), does it.
    """
    setting = dict(spec.train.activation_checkpointing)
    new_name = hasattr(type(model), "is_activation_checkpointing")  # transformers >= 5
    on = getattr(model, "is_activation_checkpointing" if new_name else
                 "is_gradient_checkpointing", False)
    if on:
        getattr(model, "activation_checkpointing_disable" if new_name else
                "gradient_checkpointing_disable")()
        if setting["mode"] == "none":
            setting["mode"] = "full"
    return setting


def parallel_settings(spec: Spec, checkpointing: dict) -> ParallelSettings:
    """The YAML's ``train.activation_checkpointing`` (as :func:`activation_checkpointing_of`
    read it), ``train.compile`` and ``distributed.mixed_precision`` for
    :func:`~pp_core.parallel.compose.parallelize`."""
    options = dict(spec.train.compile)
    return ParallelSettings(activation_checkpointing=checkpointing["mode"],
                            checkpoint_every=checkpointing["every"],
                            compile=options if options.pop("enabled") else None,
                            mixed_precision=spec.distributed.mixed_precision)


def _set_lr(optimizers, base_lrs, factor: float) -> float:
    """Scale every group's learning rate from the YAML's (not a resumed checkpoint's) value."""
    for optimizer, bases in zip(optimizers, base_lrs):
        for group, base in zip(optimizer.param_groups if optimizer else (), bases):
            group["lr"] = base * factor
    return next((b for bases in base_lrs for b in bases), 0.0) * factor


def _mean_over_dp(value: float | None, ctx: RankContext) -> float | None:
    """The mean over dp replicas of a value only the last-stage ranks hold, on every rank."""
    buffer = torch.tensor([0.0 if value is None else float(value),
                           0.0 if value is None else 1.0], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(buffer)
    return float(buffer[0] / buffer[1]) if buffer[1] > 0 else None


def _resume_step(spec: Spec, pipe, optimizers, ctx: RankContext, say) -> int:
    resume = resume_setting(spec)  # after a restart: the latest checkpoint this launch saved
    if not resume:
        return 0
    # torch's DCP and the DTensor it imports take seconds: a run that never resumes, saves or
    # exports starts training without them
    from pp_core.checkpoint import load_checkpoint, resume_checkpoint  # lazy: DCP, seconds

    verify = spec.checkpoint.verify  # free when this command's preflight verified it already
    path = resume_checkpoint(spec.checkpoint.dir, resume, verify)
    if path is None:
        say(f"checkpoint.resume: no checkpoint in {spec.checkpoint.dir!r} yet; starting at "
            f"step 0")
        return 0
    if ctx.rank == 0:
        phase(f"loading checkpoint {path}")
    step = load_checkpoint(path, pipe.model_parts, optimizers, verify=verify)
    say(f"resumed from {path} (step {step})")
    return step


def _evaluate(spec: Spec, pipe, ctx: RankContext, global_batch: int) -> float | None:
    losses = []
    for index, (inputs, target) in enumerate(build_dataset(spec, evaluation=True)):
        if index >= spec.train.eval_steps:
            break
        with torch.no_grad():
            loss = pipe.eval_step(_local(inputs, ctx, global_batch),
                                  target=_local(target, ctx, global_batch))
        losses.append(_mean_over_dp(None if loss is None else float(loss), ctx))
    return sum(losses) / len(losses) if losses and losses[0] is not None else None


def train(spec: Spec) -> dict[str, Any]:
    """Run this rank's part of the pipeline; rank 0 returns the summary (see ``format_summary``)."""
    started, begun = time.perf_counter(), time.time()
    ctx = RankContext(spec)
    if ctx.rank == 0:
        weights = " and loading its weights" if spec.model.args.get("checkpoint") or \
            isinstance(spec.model.args.get("config"), str) else ""
        phase(f"building the model and its pipeline on {ctx.world_size} rank(s){weights}")
    pipe, optimizers, num_params, dp_units, aux_losses = _build(spec, ctx)
    config = spec.pipeline
    base_lrs = [[g["lr"] for g in o.param_groups] if o else [] for o in optimizers]
    recorder = RunRecorder(spec, ctx, pipe, num_params)
    say = recorder.say
    start_step = _resume_step(spec, pipe, optimizers, ctx, say)
    recorder.open_metrics(start_step)
    recorder.attempts = attempts = Attempts(spec, ctx.rank, begun)
    recorder.checkpoints = checkpoints = Checkpoints(spec, ctx, recorder, attempts)
    restarted = attempts.resumed(start_step)
    if restarted:
        say(restarted)
    train_cfg, steps = spec.train, spec.train.steps
    params = [p for mine in _distinct_parameters(pipe.model_parts) for p in mine]
    counted_once = tied_copies(pipe.model_parts, pipe.stage_indices)
    batches = _batches(build_dataset(spec), start_step)
    global_batch = spec.global_batch_size
    progress = Progress(steps, start_step, spec.output.progress if ctx.rank == 0 else "off",
                        train_cfg.log_every)
    recorder.progress = progress
    for step in range(start_step + 1, steps + 1):
        try:
            inputs, target = next(batches)
        except StopIteration:
            raise PipelineError(f"dataset {spec.data.name!r} ran out after {step - 1} steps; "
                                f"train.steps={steps} needs more batches") from None
        lr = _set_lr(optimizers, base_lrs, lr_factor(step, train_cfg))
        local_inputs = _local(inputs, ctx, global_batch,
                              kwargs_chunk_dims(pipe.model_parts[0], inputs))
        local_target = _local(target, ctx, global_batch)
        for param in params:
            param.grad = None
        t0 = time.perf_counter()
        loss = recorder.timed_step(pipe, local_inputs, local_target)
        finish_gradients(params, 1 if config.scale_grads_in_schedule else config.num_microbatches)
        grad_norm = clip_grad_norm(params, train_cfg.grad_clip, ctx.meshes.pp.get_group(),
                                   counted_once, ep_group=ctx.meshes.ep_group)
        global_loss = _mean_over_dp(None if loss is None else float(loss), ctx)
        # the same loss and norm on every rank, so every rank decides alike (pp_core.app.rank.health)
        if apply_update(step, global_loss, grad_norm, train_cfg.on_nonfinite, say):
            for optimizer in optimizers:
                if optimizer is not None:
                    optimizer.step()
        step_time = time.perf_counter() - t0
        tokens = num_tokens(inputs)
        extra = {"aux_loss": _aux_loss(pipe, ctx, config)} if aux_losses else None
        recorder.record_step(step, global_loss, step_time, tokens, grad_norm, lr, t0,
                             data=batch_figures(inputs, target), extra=extra)
        recorder.note_restart(attempts.step_done(step, step_time))
        progress.update(step, global_loss, tokens / step_time, step_time)
        if train_cfg.eval_every and step % train_cfg.eval_every == 0:
            recorder.record_eval(step, _evaluate(spec, pipe, ctx, global_batch))
        checkpoints.after_step(step, pipe, optimizers)
        if spec.checkpoint.export_hf:
            from pp_core.app.export.run import export_due, export_from_run  # lazy: as DCP's

            if (export_dir := export_due(spec, step)) is not None:
                say(f"exported: {export_from_run(spec, pipe.model_parts, export_dir)}")
    checkpoints.close()  # the last background save is complete before the run ends
    progress.close()
    result = recorder.finish(start_step, time.perf_counter() - started, dp_units)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _aux_loss(pipe, ctx: RankContext, config) -> float:
    """The step's auxiliary loss: summed over layers, averaged over microbatches and dp ranks."""
    values = pop_aux_losses(pipe.model_parts)
    total = torch.tensor([float(sum(float(v) for v in values))], dtype=torch.float64,
                         device=ctx.device)
    dist.all_reduce(total)
    return float(total) / (ctx.dims.dp * config.num_microbatches)


def _local(batch, ctx: RankContext, global_batch: int, dims=None):
    """This dp rank's share of a global batch (:func:`~pp_core.app.factories.dp_slice`)."""
    return dp_slice(batch, ctx.meshes.dp_rank, ctx.dims.dp, global_batch, dims)


def _batches(data, start_step: int):
    """An iterator over the dataset from batch ``start_step`` on (a resumed run's position).

    A dataset with ``skip(n)`` jumps there; any other iterable is replayed from the start.
    """
    if start_step and hasattr(data, "skip"):
        data.skip(start_step)
        return iter(data)
    batches = iter(data)
    for _ in range(start_step):
        next(batches)
    return batches
