"""A measured profile made to cost what a layout adds: :func:`layout_profile`,
:func:`with_gradient_sync`.

The profile is measured once per tp degree; the other degrees change arithmetic only:

* **sharing cores**: the world's processes share this machine's; one pipeline's ranks get
  ``cores / threads * pp / world`` ranks' worth (:func:`pp_core.devices.shared_processors`),
  counted in units of what a tp stage had when it was profiled (its tp processes on
  ``min(cores, tp * threads)`` cores), and the simulator shares them out;
* **FSDP2** (``dp_shard``): the optimizer state and its step are sharded ``dp_shard`` ways;
  the parameters and gradients are held whole through the step (pp-core reshards once per
  stage and step), so they are charged whole;
* **experts** (``ep``): a MoE layer's unit keeps ``1/ep`` of its experts' parameters, and its
  forward pays the token all-to-all (counts, dispatch, combine) at the ep degree, its backward
  the same again (and once more when it recomputes the forward);
* **the data-parallel engine** (``dp``): FSDP2's hooks in every forward and backward of a
  wrapped module (a unit each), and DTensor's dispatch per parameter tensor in the optimizer
  step, as measured beside the collectives (:mod:`pp_core.measure.engine`);
* **gradient sync** (``dp``): FSDP2's all-gather and reduce-scatter and the replicas'
  all-reduce, once per FSDP unit and step after the pipeline drains (a rank's share of the
  split's modules counts its units), added to each plan's step
  (:meth:`pp_core.planning.collectives.Collectives.gradient_sync_s`), the slowest rank's.
"""

from __future__ import annotations

from dataclasses import replace

from pp_core.devices import cpu_cores
from pp_core.parallel.dims import ParallelDims
from pp_core.planning.collectives import Collectives, EngineCosts
from pp_core.planning.costs import ModelProfile, UnitCost

__all__ = ["expert_layers", "unit_experts", "layout_profile", "with_gradient_sync",
           "layout_processors"]


def expert_layers(model) -> list:
    """The model's MoE layers: modules with ``num_experts``, ``top_k`` and an ``experts``
    child (moe_gpt's ``MoE`` and any layer built the same way)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "num_experts", None), int)
            and isinstance(getattr(m, "top_k", None), int) and hasattr(m, "experts")]


def unit_experts(model, unit_fqns) -> list[tuple[int, int, int, int]]:
    """Per unit: ``(moe layers, expert parameter bytes, top_k, num_experts)``."""
    found = []
    for fqns in unit_fqns:
        layers = [layer for fqn in fqns for layer in _layers_under(model, fqn)]
        expert_bytes = sum(p.numel() * p.element_size()
                           for layer in layers for p in layer.experts.parameters())
        found.append((len(layers), expert_bytes, max([l.top_k for l in layers] + [0]),
                      max([l.num_experts for l in layers] + [0])))
    return found


def _layers_under(model, fqn: str) -> list:
    try:
        return expert_layers(model.get_submodule(fqn))
    except AttributeError:  # a parameter's FQN, not a module's: it holds no layer
        return []


def layout_processors(dims: ParallelDims, world: int, threads: int, device: str) -> float:
    """How many ranks' worth of processors one pipeline's ranks share (0: one each), as the
    simulator takes it (module docstring)."""
    if device != "cpu":
        return 0.0
    cores = cpu_cores()
    profiled_share = min(1.0, cores / (max(1, threads) * dims.tp))
    processors = cores / max(1, threads) * dims.pp / world / profiled_share
    return processors if processors < dims.pp else 0.0


def layout_profile(profile: ModelProfile, dims: ParallelDims, world: int, layout,
                   collectives: Collectives | None, experts) -> ModelProfile:
    """``profile`` (measured at ``dims.tp``) as the layout ``dims`` of ``world`` runs it."""
    units, costs = profile.units, collectives or Collectives()
    if dims.ep > 1 and experts:
        units = tuple(_at_ep(unit, entry, dims.ep, costs)
                      for unit, entry in zip(units, experts))
    per_tensor = 0.0
    if dims.dp > 1:
        units = tuple(_wrapped(unit, costs.engine) for unit in units)
        # a tp profile's parameters were DTensors already: its rate holds their dispatch
        per_tensor = costs.engine.step_s_per_tensor if dims.tp == 1 else 0.0
    return replace(profile, units=units,
                   processors=layout_processors(dims, world, layout.threads_per_rank,
                                                layout.device),
                   optimizer_bytes_per_param_byte=profile.optimizer_bytes_per_param_byte
                   / dims.dp_shard,
                   optimizer_s_per_param_byte=profile.optimizer_s_per_param_byte / dims.dp_shard,
                   optimizer_s_per_tensor=per_tensor)


def _wrapped(unit: UnitCost, engine: EngineCosts) -> UnitCost:
    """``unit`` in one FSDP2 module (a block is one; the rest of a stage shares its part's):
    the engine's hooks in every forward and backward."""
    if not (engine.forward_s or engine.backward_s):
        return unit
    return unit.retimed(forward_s=engine.forward_s, backward_s=engine.backward_s)


def _at_ep(unit: UnitCost, entry, ep: int, collectives: Collectives) -> UnitCost:
    layers, expert_bytes, top_k, num_experts = entry
    if not layers:
        return unit
    tokens = unit.output_bytes * top_k  # each token goes to top_k experts and comes back
    one = collectives.seconds("all_to_all", ep, 8 * num_experts) + \
        2 * collectives.seconds("all_to_all", ep, tokens)
    traffic = layers * one
    dropped = int(expert_bytes * (1 - 1 / ep))
    trainable = None if unit.trainable_param_bytes is None else \
        max(0, unit.trainable_param_bytes - dropped)
    recompute = tuple((mode, f + traffic, b + 2 * traffic, i + 2 * traffic, saved, transient)
                      for mode, f, b, i, saved, transient in unit.recompute)
    return replace(unit, forward_s=unit.forward_s + traffic,
                   backward_s=unit.backward_s + traffic,
                   input_grad_s=unit.input_grad_s + traffic,
                   param_bytes=max(0, unit.param_bytes - dropped),
                   trainable_param_bytes=trainable, recompute=recompute)


def with_gradient_sync(ranking, dims: ParallelDims, collectives: Collectives | None) -> None:
    """Add each plan's data-parallel collectives to its predicted step, in place, and rank
    the kept plans again."""
    if collectives is None or dims.dp == 1:
        return
    for candidate in ranking.kept + ranking.dropped:
        if candidate.predicted_step_s is None or not candidate.memory:
            continue
        # FSDP units on a rank: its share of the split's modules (a block each, the rest
        # of a stage with its root)
        pieces = -(-sum(map(len, candidate.fqns_per_stage or [[]])) // dims.pp)
        candidate.predicted_step_s += max(
            collectives.gradient_sync_s(m.grads, m.params, dims.dp_replicate, dims.dp_shard,
                                        pieces) for m in candidate.memory)
    ranking.kept.sort(key=lambda c: (c.predicted_step_s, c.peak_bytes))
