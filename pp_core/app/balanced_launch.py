"""``model.splitter: balanced`` in YAML: profile once, before launch, and give every rank the cut.

Timing differs from process to process (another rank's load, a cold cache), so ranks that each
profiled would cut the model in different places. ``pp-core run`` therefore profiles in the
launching process - the model built with the run's seed, the first batch of the dataset, one
microbatch of ``pp_microbatch_size``, on the device and with the thread count a rank gets - and
writes the cut into ``pipeline.module_fqns_per_model_part`` of the spec every rank receives: the
inputs of every rank's split are identical, so is the split (``build_pipeline`` checks it).

:func:`spec_model_and_batch` and :func:`profile_spec` are reusable by anything that measures or
plans from a YAML file.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

from pp_core.errors import ConfigError
from pp_core.app.spec import Spec

__all__ = ["spec_model_and_batch", "profile_spec", "balanced_spec", "wants_balanced",
           "as_a_rank"]


def wants_balanced(spec: Spec) -> bool:
    name = spec.model.get("splitter")
    return name is not None and name.lower() == "balanced"


def rank_threads(spec: Spec) -> int:
    """The intra-op threads a CPU rank runs with (as :class:`pp_core.app.train.RankContext` sets)."""
    from pp_core.devices import cpu_threads_per_rank, local_ranks

    return cpu_threads_per_rank(local_ranks(spec.distributed))


@contextlib.contextmanager
def as_a_rank(spec: Spec, device):
    """Measure with the thread count a rank gets on ``device`` (CPU: :func:`rank_threads`), so
    that times taken in the launching process are a rank's; the count is restored after."""
    import torch

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(rank_threads(spec))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spec_model_and_batch(spec: Spec, plugins=None):
    """``(model, inputs, target, device)`` as a rank builds and feeds them: the model with
    ``train.seed`` and ``model.args`` (cast to ``model.dtype``) on the ranks' device
    (``cuda:0`` when they get GPUs), and the dataset's first batch. For anything that measures
    the spec's model in the launching process."""
    import torch

    from pp_core.devices import choose
    from pp_core.app.factories import dataset_args, dataset_factory, model_factory

    device = torch.device("cuda", 0) if choose(spec).device == "cuda" else torch.device("cpu")
    torch.manual_seed(spec.train["seed"])
    model = model_factory(spec, plugins)(**spec.model["args"])
    dtype = spec.model.get("dtype")  # as the ranks build it (pipeline.dtype casts no parameter)
    model = model.to(device=device, dtype=getattr(torch, dtype)) if dtype is not None \
        else model.to(device)
    factory = dataset_factory(spec, plugins)
    inputs, target = next(iter(factory(**dataset_args(spec, factory))))
    return model, inputs, target, device


def profile_spec(spec: Spec, microbatch_sizes: Optional[Sequence[int]] = None, plugins=None,
                 *, repeats: int = 5):
    """``{microbatch_size: ModelProfile}`` of the spec's model, measured in this process
    (:func:`spec_model_and_batch`); on the CPU with a rank's thread count. Activation
    checkpointing and compile (``train.*``) are not applied: their costs are not in it."""
    from pp_core.losses import resolve_loss
    from pp_core.runtime.profile import profile_model

    config = spec.pipeline_config()
    sizes = list(microbatch_sizes or [config.pp_microbatch_size])
    model, inputs, target, device = spec_model_and_batch(spec, plugins)
    with as_a_rank(spec, device):
        return profile_model(model, inputs, target, resolve_loss(config.loss_fn), sizes, device,
                             repeats=repeats, config=config, plugins=plugins)


def balanced_spec(spec: Spec, plugins=None,
                  say: Optional[Callable[[str], None]] = None) -> Spec:
    """The spec every rank gets: ``module_fqns_per_model_part`` cut by measured time.

    The stage count is the one the run plans (the schedule's stages per rank, or
    ``layers_per_stage``); ``say`` gets one line per stage with its measured seconds.
    """
    from pp_core.planning.balance import balance, stage_fqns, unit_costs

    if spec.pipeline["module_fqns_per_model_part"] is not None:
        raise ConfigError("model.splitter: balanced cuts the model itself, but pipeline."
                          "module_fqns_per_model_part names the stages too; remove one of them")
    if spec.distributed["nnodes"] > 1:
        raise ConfigError("model.splitter: balanced profiles on the launching machine, and each "
                          "of several nodes would measure its own cut; profile once (pp_core."
                          "app.balanced_launch.profile_spec) and put the cut into pipeline."
                          "module_fqns_per_model_part")
    num_stages = _num_stages(spec, plugins)
    size = spec.pipeline["pp_microbatch_size"]
    profile = profile_spec(spec, [size], plugins)[size]
    costs = unit_costs(profile)
    counts = balance(costs, num_stages)
    stages = stage_fqns([unit.fqns for unit in profile.units], counts)
    start = 0
    for index, count in enumerate(counts):
        if say is not None:
            say(f"balanced split: stage {index}: {count} unit(s), "
                f"{sum(costs[start:start + count]) * 1e3:.2f} ms forward+backward per "
                f"microbatch ({stages[index][0]} .. {stages[index][-1]})")
        start += count
    values = spec.to_dict()
    values["pipeline"].update(module_fqns_per_model_part=stages, layers_per_stage=None,
                              round_virtual_stages_to_pp_multiple=None)
    return Spec(values, spec.source)


def _num_stages(spec: Spec, plugins) -> int:
    """The stage count the run will have (schedule, ``layers_per_stage``), planned on the meta
    device with the splitter that gives the model its units."""
    import torch

    from pp_core.app.factories import model_factory
    from pp_core.planning.plan import plan_pipeline

    with torch.device("meta"):
        model = model_factory(spec, plugins)(**spec.model["args"])
    return plan_pipeline(model, spec.pipeline_config(), spec.distributed["pp_size"],
                         plugins=plugins).split.num_stages
