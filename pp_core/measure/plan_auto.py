"""``plan_auto``: profile a model, choose the plan, and return a concrete PipelineConfig.

This is the entry point behind ``pipeline.pp_schedule: auto``: ``build_pipeline`` itself never
plans (it would have to time the model on every rank and the ranks could disagree), it refuses
``"auto"`` and names this function. Every rank must run the same plan, so the decision is made
once: with a ``group``, rank 0 of it profiles and chooses and broadcasts the ranking (the link is
measured by all ranks together); without one (the YAML launcher's parent process, or one
process), the caller is the only one deciding and hands the resulting config to every rank.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from pp_core.config import PipelineConfig
from pp_core.devices import cpu_cores, shared_processors
from pp_core.errors import ConfigError
from pp_core.losses import counts_tokens, resolve_loss
from pp_core.measure.link import measure_p2p, measure_p2p_busy
from pp_core.measure.optimizer_step import measure_optimizer_rate
from pp_core.measure.overhead import measure_action_overhead
from pp_core.measure.profile import profile_model
from pp_core.measure.recompute import RECOMPUTE_MODES
from pp_core.planning.choose import Candidate, Ranking, choose_plan, seq_chunk_choices
from pp_core.planning.costs import Link
from pp_core.planning.sizes import parse_size
from pp_core.plugin_manager import plugins_or_default
from pp_core.runtime.microbatch import iter_tensors

__all__ = ["AutoPlan", "plan_auto", "default_microbatch_sizes", "concrete_config"]


@dataclass
class AutoPlan:
    """The chosen plan: ``config`` is what to give ``build_pipeline`` (same on every rank)."""

    config: PipelineConfig
    ranking: Ranking
    profile_s: float = 0.0
    link: Link | None = None
    """The link the plan was made for (:class:`~pp_core.planning.costs.Link`); ``None``: none."""
    profiles: dict | None = None
    """``{microbatch size: ModelProfile}``: rank again (another cap) without profiling again."""
    seq_chunks: tuple = (1,)
    """The ``pp_seq_chunks`` values planned (:func:`~pp_core.planning.choose.seq_chunk_choices`)."""

    @property
    def processors(self) -> float | None:
        """The processors the ranks were predicted to share (``None``: one each)."""
        shared = next(iter(self.profiles.values())).processors if self.profiles else 0.0
        return shared or None

    @property
    def chosen(self) -> Candidate:
        return self.ranking.chosen

    @property
    def predicted_step_s(self) -> float:
        return self.chosen.predicted_step_s

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_dict(), "profile_s": self.profile_s,
                "link": None if self.link is None else self.link.to_dict(),
                "processors": self.processors, "ranking": self.ranking.to_dict()}


def default_microbatch_sizes(pp_batch_size: int, pp_size: int, limit: int = 4) -> list[int]:
    """The divisors of ``pp_batch_size`` worth profiling: those that still give every rank a
    microbatch (``pp_batch_size / size >= pp_size``), at most ``limit`` of them, smallest
    microbatch counts dropped first (the fewest microbatches have the largest bubble)."""
    sizes = [d for d in range(1, pp_batch_size + 1)
             if pp_batch_size % d == 0 and pp_batch_size // d >= pp_size]
    return sizes[:limit] or [1]


def concrete_config(config: PipelineConfig, candidate: Candidate) -> PipelineConfig:
    """``config`` with the candidate's schedule, microbatch size, split and pool filled in."""
    o = candidate.option
    return dataclasses.replace(
        config, pp_schedule=o.schedule, pp_schedule_csv=None, pp_microbatch_size=o.microbatch_size,
        layers_per_stage=None, round_virtual_stages_to_pp_multiple=None,
        module_fqns_per_model_part=[list(stage) for stage in candidate.fqns_per_stage],
        pp_recv_buffer_pool=config.pp_recv_buffer_pool or candidate.pool,
        pp_seq_chunks=o.seq_chunks)


def plan_auto(model, config: PipelineConfig, inputs, target, pp_size: int, *,
              device="cpu", memory_cap: int | str | None = None, plugins=None, group=None,
              microbatch_sizes: Sequence[int] | None = None,
              link: Link | Sequence[float] | None = None, schedules=None,
              repeats: int = 5, processors: float | str | None = "auto",
              shard_parts=None, activation_checkpointing="none", every: int = 1,
              degrees=None) -> AutoPlan:
    """Profile ``model`` on ``device``, choose the fastest plan that fits, return it.

    :param inputs, target: one step's batch (``pp_batch_size`` samples), real tensors.
    :param pp_size: pipeline ranks the plan is for.
    :param memory_cap: bytes per rank (or ``"8GiB"``); ``None``: no cap.
    :param group: a process group of the pp ranks: rank 0 decides, every rank gets the same plan
        (a collective: call it on every rank of the group). ``None``: this process decides.
    :param link: the :class:`~pp_core.planning.costs.Link` between ranks, or its figures in
        field order: ``(latency_s, bytes_per_s)``, optionally followed by the busy times of a
        hand-off (:func:`pp_core.measure.link.measure_p2p_busy`) and the executor's time per
        action (:func:`pp_core.measure.overhead.measure_action_overhead`); default: all
        measured over ``group``, or none (0 s, unlimited) without one.
    :param schedules: restrict the choice (``{name: ScheduleDef}``); default: the installed.
    :param repeats: timed microbatches per unit and size (their median counts).
    :param processors: how many ranks' worth of processors the pipeline's ranks share
        (:func:`pp_core.devices.shared_processors`); ``"auto"``: on the CPU, this machine's
        cores over this process's threads, for ``LOCAL_WORLD_SIZE`` ranks here (default: the
        ``pp_size`` ranks); ``None``: every rank has its own.
    :param shard_parts: how a rank shards its parts (tensor parallelism), applied to the
        profiled units (:func:`pp_core.measure.profile.profile_model`): every process of its
        tp mesh must call this together, and each returns the plan for its own shard.
    :param activation_checkpointing: ``"none"`` (default), a mode for every stage, a list of
        one mode per stage, or ``"auto"``: chosen per stage with the split under the cap
        (:mod:`pp_core.planning.recompute`); the profile then measures the modes it may pick.
        ``every`` as ``train.activation_checkpointing.every``.
    :param degrees: the layout's degrees by YAML name, carried by every plan object.
    """
    if not isinstance(config, PipelineConfig):
        raise ConfigError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if config.pp_schedule_csv is not None:
        raise ConfigError("plan_auto chooses the schedule, but pp_schedule_csv is set; unset "
                          "it (a CSV fixes the schedule: use build_pipeline directly)")
    cap = None if memory_cap is None else parse_size(memory_cap, "memory_cap")
    plugins = plugins_or_default(plugins)
    if link is not None:
        link = Link.of(link)
    elif group is not None:
        link = Link(*measure_p2p(group), *measure_p2p_busy(group),
                    measure_action_overhead(group, device=device))
    ranking, profile_s, profiles = None, 0.0, None
    chunks = slice_choices(config, model, inputs)
    if group is None or _group_rank(group) == 0:
        started = time.perf_counter()
        profiles = _profiles(model, config, inputs, target, pp_size, device, microbatch_sizes,
                             link, plugins, repeats, shard_parts,
                             recompute_modes(activation_checkpointing))
        shared = _processors(processors, device, pp_size)
        profiles = {size: dataclasses.replace(p, processors=shared)
                    for size, p in profiles.items()}
        profile_s = time.perf_counter() - started
        ranking = choose_plan(profiles, pp_size, config.pp_batch_size,
                              schedules if schedules is not None else plugins.schedules, cap,
                              recv_buffer_pool=True if config.pp_recv_buffer_pool else None,
                              pool_slack=config.pp_recv_buffer_pool_slack,
                              activation_checkpointing=activation_checkpointing, every=every,
                              degrees=degrees, seq_chunks=chunks)
    if group is not None:
        ranking, profile_s, profiles = _broadcast((ranking, profile_s, profiles), group)
    return AutoPlan(concrete_config(config, ranking.chosen), ranking, profile_s, link, profiles,
                    chunks)


def slice_choices(config: PipelineConfig, model, inputs) -> tuple[int, ...]:
    """The ``pp_seq_chunks`` values to plan for ``model`` on rows like ``inputs``' (dim 1 of
    their first tensor of 2+ dims, or ``pp_seq_len``): for ``auto``, K in 1, 2, 4, 8 dividing
    the rows when the model says ``pp_seq_slices`` and the loss is token-normalised, else 1."""
    if config.pp_seq_chunks != "auto":
        return (config.pp_seq_chunks,)
    length = config.pp_seq_len or next(
        (t.shape[1] for t in iter_tensors(inputs) if t.dim() >= 2), None)
    inner = getattr(model, "module", model)
    sliceable = bool(getattr(inner, "pp_seq_slices", False)) and config.loss_fn is not None \
        and counts_tokens(resolve_loss(config.loss_fn))
    return seq_chunk_choices("auto", length, sliceable)


def recompute_modes(setting) -> tuple[str, ...]:
    """The activation-checkpointing modes to profile for a setting (``auto``: every built-in)."""
    if setting == "auto":
        return RECOMPUTE_MODES
    chosen = [setting] if isinstance(setting, str) else list(setting)
    return tuple(m for m in RECOMPUTE_MODES if m in chosen)


def _profiles(model, config, inputs, target, pp_size, device, sizes, link, plugins, repeats,
              shard_parts, modes=()):
    if config.loss_fn is None:
        raise ConfigError("plan_auto times the loss with the last unit: set config.loss_fn")
    sizes = list(sizes) if sizes is not None else \
        default_microbatch_sizes(config.pp_batch_size, pp_size)
    parts_like = dataclasses.replace(config, pp_schedule="1f1b")  # dtype, patches: as run
    profiles = profile_model(model, inputs, target, resolve_loss(config.loss_fn), sizes, device,
                             repeats=repeats, config=parts_like, plugins=plugins,
                             p2p=link if link is not None else Link(), shard_parts=shard_parts,
                             recompute_modes=modes)
    rate = measure_optimizer_rate(model, device)
    return {size: dataclasses.replace(p, optimizer_s_per_param_byte=rate)
            for size, p in profiles.items()}


def _processors(processors, device, pp_size: int) -> float:
    """``processors`` as the profile records it (0.0: one per rank)."""
    if processors == "auto":
        if torch.device(device).type != "cpu":
            return 0.0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", pp_size))
        processors = shared_processors(cpu_cores(), torch.get_num_threads(), local, pp_size)
    if processors is None:
        return 0.0
    if isinstance(processors, bool) or not isinstance(processors, (int, float)) \
            or not processors > 0:
        raise ConfigError(f"processors={processors!r} must be a number > 0, 'auto' or None")
    return float(processors)


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _broadcast(value, group):
    """``value`` of the group's first rank, on every rank of the group."""
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]
