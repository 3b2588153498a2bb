"""The spec's model measured in the launching process, as a rank would run it.

``pipeline.pp_schedule: auto`` and ``model.splitter: balanced`` decide from timings, and timings
differ from process to process (another rank's load, a cold cache); so they are taken once,
here, before any rank exists: the model built with the run's recipe
(:func:`pp_core.app.factories.build_model`), the dataset's first batch, on the device and with
the thread count a rank gets (:class:`~pp_core.app.layout.RankLayout`). :func:`profile_spec` is
reusable by anything that measures or plans from a YAML file.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from pp_core.app.factories import build_dataset, build_model
from pp_core.app.layout import RankLayout
from pp_core.app.spec import Spec
from pp_core.losses import resolve_loss
from pp_core.measure.profile import profile_model

__all__ = ["model_and_batch", "as_a_rank", "profile_spec"]


def model_and_batch(spec: Spec, layout: RankLayout, plugins=None):
    """``(model, inputs, target, device)`` as a rank builds and feeds them: the model on the
    ranks' device (``cuda:0`` when they get GPUs), and the dataset's first batch."""
    device = torch.device("cuda", 0) if layout.device == "cuda" else torch.device("cpu")
    model = build_model(spec, plugins).to(device)
    inputs, target = next(iter(build_dataset(spec, plugins)))
    return model, inputs, target, device


@contextlib.contextmanager
def as_a_rank(layout: RankLayout, device: torch.device):
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
                 *, repeats: int = 5, layout: RankLayout | None = None):
    """``{microbatch_size: ModelProfile}`` of the spec's model, measured in this process
    (:func:`model_and_batch`); on the CPU with a rank's thread count. Activation
    checkpointing and compile (``train.*``) are not applied: their costs are not in it."""
    layout = RankLayout.of(spec) if layout is None else layout
    config = spec.pipeline
    sizes = list(microbatch_sizes or [config.pp_microbatch_size])
    model, inputs, target, device = model_and_batch(spec, layout, plugins)
    with as_a_rank(layout, device):
        return profile_model(model, inputs, target, resolve_loss(config.loss_fn), sizes, device,
                             repeats=repeats, config=config, plugins=plugins)
