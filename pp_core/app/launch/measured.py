"""The spec's model measured in the launching process, as a rank would run it.

``pipeline.pp_schedule: auto`` and ``model.splitter: balanced`` decide from timings, and timings
differ from process to process (another rank's load, a cold cache); so they are taken once,
here, before any rank exists: the model built with the run's recipe
(:func:`pp_core.app.factories.build_model`), the dataset's first batch, on the device and with
the thread count a rank gets (:class:`~pp_core.app.machine.MachineShare`). :func:`profile_spec` is
reusable by anything that measures or plans from a YAML file.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from pp_core.app.factories import build_dataset, build_model
from pp_core.app.machine import MachineShare
from pp_core.app.spec import Spec
from pp_core.losses import resolve_loss
from pp_core.measure.helpers import HELPER_TIMEOUT_S, run_helpers
from pp_core.measure.plan_auto import plan_auto
from pp_core.measure.profile import profile_model
from pp_core.parallel.dims import ParallelDims
from pp_core.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["model_and_batch", "as_a_rank", "profile_spec", "plan_sharded"]


def model_and_batch(spec: Spec, layout: MachineShare, plugins=None):
    """``(model, inputs, target, device)`` as a rank builds and feeds them: the model on the
    ranks' device (``cuda:0`` when they get GPUs), and the dataset's first batch."""
    device = torch.device("cuda", 0) if layout.device == "cuda" else torch.device("cpu")
    model = build_model(spec, plugins).to(device)
    inputs, target = next(iter(build_dataset(spec, plugins)))
    return model, inputs, target, device


@contextlib.contextmanager
def as_a_rank(layout: MachineShare, device: torch.device):
    """Measure with the thread count a rank gets on ``device`` (CPU:
    ``layout.threads_per_rank``), so that times taken here are a rank's; restored after."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(layout.threads_per_rank)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def profile_spec(spec: Spec, microbatch_sizes: Optional[Sequence[int]] = None, plugins=None,
                 *, repeats: int = 5, layout: MachineShare | None = None):
    """``{microbatch_size: ModelProfile}`` of the spec's model, measured in this process
    (:func:`model_and_batch`); on the CPU with a rank's thread count. Activation
    checkpointing and compile (``train.*``) are not applied: their costs are not in it."""
    layout = MachineShare.of(spec) if layout is None else layout
    config = spec.pipeline
    sizes = list(microbatch_sizes or [config.pp_microbatch_size])
    model, inputs, target, device = model_and_batch(spec, layout, plugins)
    with as_a_rank(layout, device):
        return profile_model(model, inputs, target, resolve_loss(config.loss_fn), sizes, device,
                             repeats=repeats, config=config, plugins=plugins)


def plan_sharded(spec: Spec, layout: MachineShare, **plan_args):
    """The :class:`~pp_core.measure.plan_auto.AutoPlan` of ``spec`` with its stages sharded
    ``distributed.tp_size`` ways, profiled by that many local processes together (module
    docstring); ``plan_args`` go to :func:`~pp_core.measure.plan_auto.plan_auto` (no
    ``plugins``: the helpers load the installed ones)."""
    tp = spec.dims.tp
    with tempfile.TemporaryDirectory(prefix="pp-core-tp-") as tmp:
        out = os.path.join(tmp, "plan")
        run_helpers(_sharded_worker, (spec.to_dict(), layout, os.path.join(tmp, "store"), out,
                                      plan_args), tp,
                    died=f"a process profiling the {tp}-way tensor-parallel stage ended before "
                         f"it finished ({{}}); nothing was planned",
                    failed=f"profiling the {tp}-way tensor-parallel stage failed")
        with open(out, "rb") as fh:
            return pickle.load(fh)


def _sharded_worker(rank: int, values: dict, layout: MachineShare, store_path: str,
                    out_path: str, plan_args: dict) -> None:
    """One tp rank of :func:`plan_sharded`: build, shard, profile and plan; the first writes
    the plan."""
    spec = Spec.from_dict(values)
    dims = ParallelDims(tp=spec.dims.tp, sequence_parallel=spec.dims.sequence_parallel)
    tp = dims.tp  # the helpers are one stage's tp ranks: pp = dp = 1
    cuda = layout.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # bounded waits: a helper whose peer or parent is gone ends by itself
    dist.init_process_group(layout.backend, store=dist.FileStore(store_path, tp), rank=rank,
                            world_size=tp, timeout=timedelta(seconds=HELPER_TIMEOUT_S))
    try:
        mesh = dims.build(device.type).tp
        model = build_model(spec).to(device)
        batch = [next(iter(build_dataset(spec))) if rank == 0 else None]
        dist.broadcast_object_list(batch, src=0)  # every tp rank takes the same input
        inputs, target = batch[0]
        sequence_parallel = dims.sequence_parallel

        def shard(parts):
            apply_tensor_parallel(parts, mesh, sequence_parallel=sequence_parallel)

        with as_a_rank(layout, device):
            plan = plan_auto(model, spec.pipeline, inputs, target, spec.distributed.pp_size,
                             device=device, shard_parts=shard, **plan_args)
        if rank == 0:
            with open(out_path, "wb") as fh:
                pickle.dump(plan, fh)
    finally:
        dist.destroy_process_group()
