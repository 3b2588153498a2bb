"""Measure a model before planning: time and memory per unit, and the link between ranks.

:func:`profile_model` cuts the model into its units (:mod:`pp_core.planning.units`), builds one
part per unit the way the runtime builds stages (:func:`~pp_core.planning.parts.build_model_parts`,
the splitter's own ``make_part``), and runs a few microbatches through them as a pipeline of one
unit per stage would: the runtime's stage call and hand-off (detached leaf inputs), the loss on
the last unit, and the runtime's own backward functions - :func:`backward_full` for B,
:func:`backward_input` then :func:`backward_weight` for I and W - so the costs the planner
simulates are the costs of what executes. Each microbatch size gets one warm-up pass (which also
records memory: saved tensors through ``saved_tensors_hooks``, once per storage, parameters
excluded; and each unit's transient peak, :mod:`pp_core.measure.transient`), one split pass
(what each unit's I leaves alive for its W, :mod:`pp_core.measure.held_for_weight`) and
``repeats`` timed passes; a time is the median, by the clock :data:`CLOCKS` says.

The link between ranks is measured apart, by :mod:`pp_core.measure.link`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from pp_core.config import PipelineConfig
from pp_core.errors import ConfigError
from pp_core.measure.held_for_weight import HeldForWeight
from pp_core.measure.link import sync
from pp_core.measure.recompute import measure_recompute
from pp_core.measure.transient import Allocations, local_tensor
from pp_core.planning.balance import stage_fqns
from pp_core.planning.costs import Link, ModelProfile, UnitCost
from pp_core.planning.parts import build_model_parts
from pp_core.planning.split import SplitPlan
from pp_core.planning.units import model_units, shared_modules, unit_splitter
from pp_core.runtime.backward import backward_full, backward_input, backward_weight
from pp_core.runtime.initializers import collect_pipeline_runtime_initializers
from pp_core.runtime.microbatch import (first_tensor, kwargs_chunk_dims, num_tokens,
                                        split_microbatches, to_device)
from pp_core.runtime.stage import Stage, as_outputs, make_stage_inputs

__all__ = ["profile_model", "CLOCKS"]



CLOCKS = ("auto", "wall", "cpu")
"""How a profile times: ``wall`` seconds, or ``cpu`` seconds of this process. ``cpu`` measures
the work itself on a shared machine (a process that waits for a core is not charged for it), and
equals wall time on an idle one; ``auto`` takes it on the CPU with one thread (torch runs the
forward and the backward in the calling thread), wall time otherwise (GPUs, thread pools)."""


def _clock(name: str, device: torch.device) -> Callable[[], float]:
    if name not in CLOCKS:
        raise ConfigError(f"profile: clock={name!r}: expected one of {', '.join(map(repr, CLOCKS))}")
    if name == "auto":
        name = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    return time.process_time if name == "cpu" else time.perf_counter


def _nbytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor: its local shard)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


class _Saved:
    """``saved_tensors_hooks`` that add up the storages autograd keeps for backward, once each;
    and the unit's allocation log (:mod:`pp_core.measure.transient`), for its transient peak."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen, self.total, self.made = exclude, set(), 0, 0
        self.inputs: set[int] = set()  # the storages of the unit's inputs (set before it runs)
        self.kept_input = 0  # of ``total``, the unit's inputs
        self.allocations = Allocations()

    def pack(self, tensor):
        try:
            storage = local_tensor(tensor).untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.exclude and key not in self.seen:
                self.seen.add(key)
                self.total += storage.nbytes()
                if key in self.allocations.live:  # made by the unit, so in its allocation log
                    self.made += storage.nbytes()
                elif key in self.inputs:
                    self.kept_input += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested)
            pass
        return tensor

    def hooks(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t))
        stack.enter_context(self.allocations.tracking())
        return stack

    def transient(self, params) -> int:
        """Bytes live at once beyond the saved ones the unit made (its inputs are not in the
        log) and the parameter gradients: what its forward and backward hold only while they
        run."""
        grads = [p.grad for p in params if p.grad is not None]
        return max(0, self.allocations.peak(grads) - self.made)


class _UnitRunner:
    """One part per unit and the runtime's stage call for each; runs one microbatch at a time."""

    def __init__(self, model, units, config, plugins, splitter, device, shard_parts=None):
        name, chosen = unit_splitter(model, plugins, splitter)
        self.shared = shared_modules(model, {fqn for unit in units for fqn in unit})
        config = _config_for(config, stage_fqns(units, [1] * len(units)))
        stages = stage_fqns(units, [1] * len(units), self.shared)
        self.dtype = config.torch_dtype if config is not None else None
        n = len(units)
        plan = SplitPlan(n, stages, name, n, 1, splitter_object=chosen)
        parts = [part.to(device) for part in build_model_parts(model, plan, range(n), config)]
        if shard_parts is not None:  # tensor parallelism: as a rank, right after the split
            shard_parts(parts)
        self.stages = [Stage(i, part, (0,) * n, 0) for i, part in enumerate(parts)]
        self.params = [list({id(p): p for p in part.parameters()}.values()) for part in parts]
        self.initializers = collect_pipeline_runtime_initializers(parts)
        self.device = device
        self.clock = time.perf_counter

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``(fn(), seconds)`` by ``self.clock``, the device synchronised around it."""
        sync(self.device)
        start = self.clock()
        result = fn()
        sync(self.device)
        return result, self.clock() - start

    def forward(self, x, target, loss_fn, index, inputs, saved=None):
        """Unit ``index`` on its inputs (the microbatch for unit 0); returns the outputs that
        need a gradient (the loss on the last unit) and all of them (to hand on)."""
        stage = self.stages[index]
        if index == 0 and self.initializers:
            for initializer in self.initializers:
                initializer.prepare(num_tokens=num_tokens(x), device=self.device)
        with torch.enable_grad(), (saved.hooks() if saved else contextlib.nullcontext()):
            output = stage(x if index == 0 else inputs)
            if stage.is_last:
                loss = loss_fn(output, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ConfigError(f"loss_fn returned {type(loss).__name__}; it must return "
                                      f"a scalar tensor (e.g. a mean over the batch)")
                return [loss.reshape(())], ()
            outs = as_outputs(output, index, self.dtype)
        return [t for t in outs if t.requires_grad], outs


def _config_for(config, stages):
    """The config the parts are built with: the caller's, naming these stages (a splitter such
    as ``hf_decoder`` reads ``module_fqns_per_model_part`` when it builds a part)."""
    base = config if config is not None else PipelineConfig()
    return dataclasses.replace(base, module_fqns_per_model_part=stages, layers_per_stage=None,
                               round_virtual_stages_to_pp_multiple=None)


def _one_microbatch(runner: _UnitRunner, x, target, loss_fn, split: bool, saved: list | None,
                    held: list | None = None):
    """Forward every unit, then backward in reverse: B, or I for all then W for all (with
    ``held``, per unit a :class:`HeldForWeight` logs each I and measures before the first W).

    Returns per unit ``(F, B or I, W or 0.0, output bytes)``."""
    n = len(runner.stages)
    forward, grad_outs, leaves, out_bytes = [0.0] * n, [None] * n, [()] * n, [0] * n
    handed = ()
    for i in range(n):
        leaves[i] = () if i == 0 else make_stage_inputs(handed, True)
        if saved:
            saved[i].inputs = {local_tensor(t).untyped_storage().data_ptr() for t in leaves[i]
                               if isinstance(t, torch.Tensor)}
        (grad_outs[i], handed), forward[i] = runner.timed(lambda i=i: runner.forward(
            x, target, loss_fn, i, leaves[i], saved[i] if saved else None))
        out_bytes[i] = _nbytes(handed)
    backward, weight, grads, pending = [0.0] * n, [0.0] * n, None, [None] * n
    for i in reversed(range(n)):
        inputs = [t for t in leaves[i] if t.requires_grad]
        if split:
            (grads_in, pending[i]), backward[i] = runner.timed(functools.partial(
                _input_pass, held[i] if held else None, grad_outs[i], grads, inputs))
            grad_outs[i] = None  # as the runtime: from here only W's state holds the graph
        else:
            with saved[i].allocations.tracking() if saved else contextlib.nullcontext():
                grads_in, backward[i] = runner.timed(
                    lambda i=i, g=grads, a=inputs: backward_full(grad_outs[i], g, a))
        grads = grads_in
    if split:
        for unit in held or ():
            unit.measure()
        for i in reversed(range(n)):
            _, weight[i] = runner.timed(lambda i=i: backward_weight(pending[i]))
    return [(forward[i], backward[i], weight[i], out_bytes[i]) for i in range(n)]


def _input_pass(held, outputs, grads, inputs):
    """The unit's I (logged by ``held`` when given); no reference to ``grads`` outlives it."""
    run = functools.partial(backward_input, outputs, grads, inputs)
    return held.input_pass(run, grads) if held is not None else run()


def _take(value, size: int, what: str, dims=None):
    """A copy of the first ``size`` rows of a batch (a tensor, or a tuple/list/dict of them):
    a view would keep (and be counted as) the whole batch's storage. ``dims``: the model's
    chunk dims (:func:`kwargs_chunk_dims`: a VLM's images go with their samples)."""
    first = first_tensor(value)
    if first is None:
        return value
    batch = first.shape[0] if first.dim() else 0
    if size > batch or batch % size:
        raise ConfigError(f"profile: microbatch size {size} does not divide the {what} batch of "
                          f"{batch}; pass a batch whose size is a multiple of every microbatch "
                          f"size (e.g. {size * max(1, batch // size or 1)})")
    return _copied(split_microbatches(value, batch // size, batch, what, dims)[0])


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        items = [_copied(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    return value


def profile_model(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable,
    microbatch_sizes: Sequence[int],
    device="cpu",
    *,
    repeats: int = 5,
    config=None,
    plugins=None,
    splitter=None,
    p2p: Link | Sequence[float] = Link(),
    clock: str = "auto",
    shard_parts: Callable[[list], Any] | None = None,
    recompute_modes: Sequence[str] = (),
) -> dict[int, ModelProfile]:
    """Measure ``model`` unit by unit; ``{microbatch_size: ModelProfile}``.

    :param inputs: a batch (dim 0 a multiple of every microbatch size); its first rows make a
        microbatch. ``target`` likewise, for ``loss_fn(output, target)``.
    :param device: where to measure; the model's parameters are moved there (in place, as
        ``model.to(device)`` does). The model's gradients and the RNG state are left as found.
    :param repeats: timed microbatches per size, after one warm-up; a time is their median.
    :param config: a :class:`~pp_core.config.PipelineConfig` whose ``dtype`` and model patches
        the parts are built with (optional).
    :param splitter: the splitter whose ``units`` define the units (default: pp-core's choice).
    :param p2p: the :class:`~pp_core.planning.costs.Link` to record, or its figures in field
        order: ``(latency_s, bytes_per_s)`` (:func:`measure_p2p`), optionally followed by the
        busy times of :func:`pp_core.measure.link.measure_p2p_busy`; default a free link.
    :param clock: ``"auto"``, ``"wall"`` or ``"cpu"`` (:data:`CLOCKS`).
    :param shard_parts: called with the unit parts (one per unit, on ``device``) right after
        they are built, as a rank shards its parts: e.g. ``lambda parts:
        apply_tensor_parallel(parts, tp_mesh)``. Every process of ``tp_mesh`` must then profile
        the same model and batch together (the collectives are in the times); bytes are what
        this process holds (a DTensor's local shard).
    :param recompute_modes: activation-checkpointing modes to measure on every unit's blocks
        (``"full"``, ``"selective"``: :mod:`pp_core.measure.recompute`); default none.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"profile: repeats={repeats!r} must be a positive int")
    sizes = list(microbatch_sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"profile: microbatch_sizes={sizes!r} must be positive ints")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("profile: the model is on the meta device; materialise it (or build "
                          "it on a real device) before profiling")
    device = torch.device(device)
    timer = _clock(clock, device)
    units = model_units(model, plugins, splitter)
    runner = _UnitRunner(model, units, config, plugins, splitter, device, shard_parts)
    runner.clock = timer
    params = [p for group in runner.params for p in group]
    kept = {id(p): p.grad for p in params}
    for p in params:  # or backward would add into the caller's gradient tensors
        p.grad = None
    exclude = {local_tensor(p).untyped_storage().data_ptr() for p in params}
    rng_devices = [device] if device.type == "cuda" else []
    result = {}
    try:
        with torch.random.fork_rng(devices=rng_devices):
            for size in sorted(set(sizes)):
                x = to_device(_take(inputs, size, "inputs", kwargs_chunk_dims(model, inputs)),
                              device, None)
                y = to_device(_take(target, size, "target"), device, None)
                result[size] = _profile_size(runner, units, x, y, loss_fn, size, repeats,
                                             exclude, Link.of(p2p))
                if recompute_modes:
                    entries = measure_recompute(runner, x, y, loss_fn, repeats, recompute_modes)
                    result[size] = dataclasses.replace(result[size], units=tuple(
                        dataclasses.replace(unit, recompute=entry)
                        for unit, entry in zip(result[size].units, entries)))
    finally:
        for p in params:
            p.grad = kept[id(p)]
    return result


def _profile_size(runner, units, x, y, loss_fn, size, repeats, exclude,
                  link: Link) -> ModelProfile:
    n = len(units)
    saved = [_Saved(exclude) for _ in range(n)]
    first = _one_microbatch(runner, x, y, loss_fn, False, saved)  # warm-up + memory
    transient = [saved[i].transient(runner.params[i]) for i in range(n)]
    held = [HeldForWeight() for _ in range(n)]  # split: what each I leaves for its W
    _one_microbatch(runner, x, y, loss_fn, True, held, held)
    samples: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in "FBIW"}
    for _ in range(repeats):
        for i, (f, b, _, _) in enumerate(_one_microbatch(runner, x, y, loss_fn, False, None)):
            samples["F"][i].append(f)
            samples["B"][i].append(b)
        for i, (f, inp, w, _) in enumerate(_one_microbatch(runner, x, y, loss_fn, True, None)):
            samples["F"][i].append(f)
            samples["I"][i].append(inp)
            samples["W"][i].append(w)
    for group in runner.params:
        for p in group:
            p.grad = None
    med = {k: [statistics.median(v) for v in lists] for k, lists in samples.items()}
    costs = tuple(
        UnitCost(fqns=tuple(units[i]), forward_s=med["F"][i], backward_s=med["B"][i],
                 input_grad_s=med["I"][i], weight_grad_s=med["W"][i],
                 activation_bytes=saved[i].total, saved_input_bytes=saved[i].kept_input,
                 param_bytes=_nbytes(runner.params[i]),
                 output_bytes=first[i][3], transient_bytes=transient[i],
                 input_grad_held_bytes=held[i].held, input_grad_freed_bytes=held[i].freed,
                 output_grad_held_bytes=held[i].received_held,
                 trainable_param_bytes=_nbytes([p for p in runner.params[i] if p.requires_grad]),
                 trained_tensors=sum(p.requires_grad for p in runner.params[i]))
        for i in range(n))
    return ModelProfile(size, costs, shared_fqns=tuple(runner.shared), device=str(runner.device),
                        **link.profile_fields())
