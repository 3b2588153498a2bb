"""What the planner knows about a model: measured cost and memory per unit of the split.

A *unit* is the smallest thing a splitter may place on a stage: the modules before ``layers``
(embedding) as one unit, each block of ``layers``, the modules after it (norm, head, loss) as
one unit. The profiler (``pp_core.measure.profile``) fills these from measurements on the
rank's own device; the balanced splitter and the planner read them. Pure data: no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

__all__ = ["UnitCost", "ModelProfile", "Link", "ALL_INPUT"]

ALL_INPUT = -1
"""``UnitCost.saved_input_bytes`` of a unit that keeps all of its input (a checkpointed one)."""


@dataclass(frozen=True)
class Link:
    """The point-to-point link between two ranks, as measured (:mod:`pp_core.measure.link`):
    what a hand-off adds to the dependency (``latency_s`` plus bytes over ``bytes_per_s``),
    what it holds each rank up (``send_busy_s`` / ``recv_busy_s`` plus bytes over
    ``busy_bytes_per_s``), and the executor's own time per compute action. The defaults are a
    free link: nothing measured."""

    latency_s: float = 0.0
    bytes_per_s: float = math.inf
    send_busy_s: float = 0.0
    recv_busy_s: float = 0.0
    busy_bytes_per_s: float = math.inf
    action_overhead_s: float = 0.0

    @classmethod
    def of(cls, value) -> "Link":
        """``value`` as a Link: a Link, or its figures in field order (the first two at least:
        ``(latency_s, bytes_per_s)``, as :func:`pp_core.measure.link.measure_p2p` gives)."""
        if isinstance(value, cls):
            return value
        figures = tuple(value)
        if not 2 <= len(figures) <= len(fields(cls)):
            raise ValueError(f"a link is {len(fields(cls))} figures "
                             f"({', '.join(f.name for f in fields(cls))}), the first two at "
                             f"least; got {len(figures)}")
        return cls(*(float(x) for x in figures))

    def profile_fields(self) -> dict:
        """The :class:`ModelProfile` fields this link fills."""
        return {"p2p_latency_s": self.latency_s, "p2p_bytes_per_s": self.bytes_per_s,
                "p2p_send_busy_s": self.send_busy_s, "p2p_recv_busy_s": self.recv_busy_s,
                "p2p_busy_bytes_per_s": self.busy_bytes_per_s,
                "action_overhead_s": self.action_overhead_s}

    def to_dict(self) -> dict:
        """Plain JSON-able data, keyed by field name."""
        return asdict(self)


@dataclass(frozen=True)
class UnitCost:
    """One unit at one microbatch size. Times in seconds, sizes in bytes."""

    fqns: tuple[str, ...]          # the module FQNs the unit is made of, in model order
    forward_s: float               # F
    backward_s: float              # B: full backward (input and weight gradients together)
    input_grad_s: float            # I: backward for inputs only
    weight_grad_s: float           # W: backward for weights only
    activation_bytes: int          # saved for backward by one microbatch's forward
    param_bytes: int               # parameters (gradients are the same size)
    output_bytes: int              # what the unit hands to the next one (boundary activation)
    # The most bytes its forward + backward hold at once beyond activation_bytes and parameter
    # gradients (temporaries: a vocabulary head's logits, log-softmax and their gradients).
    # Default 0: a profile stored before it was measured loads and predicts as it did.
    transient_bytes: int = 0
    # Split backward (I, later W), pp_core.measure.held_for_weight measures them:
    # - input_grad_held_bytes: what the unit's I allocated that is alive when its W starts,
    #   beyond activation_bytes (the gradients kept at the nodes where a parameter's side
    #   branches off the input path), the input gradient it hands back left out;
    # - input_grad_freed_bytes: saved bytes that die at I once the outputs are dropped (the
    #   nodes above its topmost boundary: a head's log-softmax); only a stage's last unit;
    # - output_grad_held_bytes: of the gradient of its output it receives, what its W holds.
    # Per stage (memory.split_held_bytes): the sum of the first and third over its units less
    # the second of its last unit - exact against a stage of two blocks and one of a block and
    # the head run whole (tests/measure/test_split_held.py): the gradient between two units of a
    # stage is held as the earlier unit's third term. Default 0: as above.
    input_grad_held_bytes: int = 0
    input_grad_freed_bytes: int = 0
    output_grad_held_bytes: int = 0
    # Of param_bytes, those that require a gradient (get one and optimizer state); None: all.
    # A unit with none is frozen: the planner drops the backward of a frozen prefix and the W
    # of a later frozen stage (pp_core.schedule.frozen).
    trainable_param_bytes: Optional[int] = None
    # Of activation_bytes, the unit's own input (what a stage's first unit keeps of a received
    # buffer, which the memory model must not count twice). ALL_INPUT: all of it (a checkpointed
    # block keeps its inputs to run its forward again). Default 0: as before it was measured.
    saved_input_bytes: int = 0
    # How many parameter tensors get a gradient (the optimizer's per-tensor work). 0: not
    # counted (a stored profile), and nothing is charged per tensor.
    trained_tensors: int = 0

    @property
    def trained_bytes(self) -> int:
        """The parameter bytes that get gradients and optimizer state."""
        return self.param_bytes if self.trainable_param_bytes is None \
            else self.trainable_param_bytes

    @property
    def trainable(self) -> bool:
        """Whether the unit holds something to train (a parameterless unit counts as frozen
        only when the profile says so)."""
        return self.trainable_param_bytes is None or self.trainable_param_bytes > 0

    # Activation checkpointing (pp_core.parallel.activation), measured per built-in mode on the
    # unit's blocks: ``(mode, forward_s, backward_s, input_grad_s, activation_bytes,
    # transient_bytes)`` - B and I with the forward run again inside them, the bytes kept for
    # backward (the block's inputs, and for ``selective`` the matmul outputs), the temporaries
    # of the recompute + backward. Empty: the unit has no block to checkpoint (or not measured).
    recompute: tuple[tuple, ...] = ()

    def modes(self) -> tuple[str, ...]:
        """The activation-checkpointing modes this unit can run: ``none`` and the measured."""
        return ("none",) + tuple(entry[0] for entry in self.recompute)

    def retimed(self, scale: float = 1.0, forward_s: float = 0.0,
                backward_s: float = 0.0) -> "UnitCost":
        """This unit with every time ``scale`` times as long, plus ``forward_s`` on each
        forward and ``backward_s`` on each backward and input-gradient pass (W runs alone),
        its recomputing variants alike: what a layout or a running pipeline adds to it."""
        recompute = tuple((mode, f * scale + forward_s, b * scale + backward_s,
                           i * scale + backward_s, saved, transient)
                          for mode, f, b, i, saved, transient in self.recompute)
        return replace(self, forward_s=self.forward_s * scale + forward_s,
                       backward_s=self.backward_s * scale + backward_s,
                       input_grad_s=self.input_grad_s * scale + backward_s,
                       weight_grad_s=self.weight_grad_s * scale, recompute=recompute)

    def under(self, mode: str) -> "UnitCost":
        """This unit as it costs with its blocks checkpointed by ``mode`` (``none``: itself).

        Between a split backward's ``I`` and ``W`` the recomputed activations ``W`` needs are
        held again: the difference to the unit's un-checkpointed saved bytes is added to
        ``input_grad_held_bytes``."""
        if mode == "none":
            return self
        for name, forward, backward, input_grad, saved, transient in self.recompute:
            if name == mode:
                return replace(self, forward_s=forward, backward_s=backward,
                               input_grad_s=input_grad, activation_bytes=saved,
                               transient_bytes=transient, recompute=(),
                               saved_input_bytes=ALL_INPUT,
                               input_grad_held_bytes=self.input_grad_held_bytes
                               + max(0, self.activation_bytes - saved))
        raise ValueError(f"unit {'/'.join(self.fqns)} has no measured activation "
                         f"checkpointing mode {mode!r} (measured: {', '.join(self.modes())})")


@dataclass(frozen=True)
class ModelProfile:
    """A model measured at one microbatch size, plus the link between ranks."""

    microbatch_size: int
    units: tuple[UnitCost, ...]    # in model order; contiguous runs of units make stages
    p2p_latency_s: float           # one small send/recv between two ranks
    p2p_bytes_per_s: float         # bandwidth of a large send/recv
    optimizer_bytes_per_param_byte: float = 2.0   # AdamW: exp_avg + exp_avg_sq
    optimizer_step_bytes_per_param_byte: float = 1.0  # AdamW foreach step's temporaries
    shared_fqns: tuple[str, ...] = ()   # parameter-free modules every stage holds (rotary table)
    device: str = ""                    # where it was measured ("cpu", "cuda:0")
    # What a cross-rank hand-off costs the ranks themselves, beyond the latency on the
    # dependency: the busy time of one send and of one receive (gloo on the CPU copies and
    # frames the bytes on both ranks), a fixed part plus bytes over a rate. Zero: not measured.
    p2p_send_busy_s: float = 0.0
    p2p_recv_busy_s: float = 0.0
    p2p_busy_bytes_per_s: float = float("inf")
    action_overhead_s: float = 0.0      # the executor's own time per compute action (any kind)
    # The optimizer step after the pipeline drains, per trained parameter byte on one processor
    # (pp_core.measure.optimizer_step); 0: not measured, and not charged.
    optimizer_s_per_param_byte: float = 0.0
    # ... and per trained tensor beyond it: DTensor's dispatch when a data-parallel engine
    # holds plain-profiled parameters (pp_core.measure.layout_costs); 0: nothing.
    optimizer_s_per_tensor: float = 0.0
    # How many ranks' worth of processors the pipeline's ranks share, when fewer than its ranks
    # (one-thread CPU ranks on a machine with fewer cores: pp_core.devices.shared_processors);
    # 0: every rank has a processor of its own. The simulator then shares them out.
    processors: float = 0.0

    def scaled(self, factor: float) -> "ModelProfile":
        """The profile with every compute time (F, B, I, W, their recomputing variants) and
        the executor's per-action time ``factor`` times as long: the units as a running
        pipeline pays for them (:mod:`pp_core.app.plan.pipeline_factor`)."""
        if factor == 1.0:
            return self
        return replace(self, units=tuple(u.retimed(factor) for u in self.units),
                       action_overhead_s=self.action_overhead_s * factor)

    def sliced(self, count: int) -> "ModelProfile":
        """The profile of one of ``count`` sequence slices of a microbatch (``pp_seq_chunks``,
        :mod:`pp_core.schedule.slices`): every unit's times and activation bytes (saved, handed
        on, held from ``I`` to ``W``, temporaries, and their recomputing variants) ``1/count``
        of the microbatch's; parameters, the link and the executor's time per action as they
        are (a slice is one more action, one more hand-off). The keys and values of the prefix a
        slice's attention reads cost nothing more: it saves the per-slice pieces its earlier
        slices hold anyway (:mod:`pp_core.runtime.prefix_attention`), so ``1/K`` is the real
        share - measured at pp 4, the worst rank's planned peak within 3% of
        ``peak_saved_bytes`` for K = 1..8 (docs/benchmarks.md)."""
        if count == 1:
            return self

        def part(value: int) -> int:
            return value if value == ALL_INPUT else -(-value // count)

        def unit(u: UnitCost) -> UnitCost:
            return replace(
                u, forward_s=u.forward_s / count, backward_s=u.backward_s / count,
                input_grad_s=u.input_grad_s / count, weight_grad_s=u.weight_grad_s / count,
                activation_bytes=part(u.activation_bytes), output_bytes=part(u.output_bytes),
                transient_bytes=part(u.transient_bytes),
                input_grad_held_bytes=part(u.input_grad_held_bytes),
                input_grad_freed_bytes=part(u.input_grad_freed_bytes),
                output_grad_held_bytes=part(u.output_grad_held_bytes),
                saved_input_bytes=part(u.saved_input_bytes),
                recompute=tuple((mode, f / count, b / count, i / count, part(saved),
                                 part(transient))
                                for mode, f, b, i, saved, transient in u.recompute))

        return replace(self, units=tuple(unit(u) for u in self.units))

    def transfer_s(self, num_bytes: int) -> float:
        """Predicted time of one point-to-point hand-off of ``num_bytes``."""
        return self.p2p_latency_s + num_bytes / self.p2p_bytes_per_s

    def send_busy_s(self, num_bytes: int) -> float:
        """Time the sending rank spends on one hand-off of ``num_bytes``."""
        return self.p2p_send_busy_s + num_bytes / self.p2p_busy_bytes_per_s

    def recv_busy_s(self, num_bytes: int) -> float:
        """Time the receiving rank spends on one hand-off of ``num_bytes``."""
        return self.p2p_recv_busy_s + num_bytes / self.p2p_busy_bytes_per_s

    def to_dict(self) -> dict:
        """Plain JSON-able data (lists, numbers, strings): to store a profile or send it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelProfile":
        """The inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unit_known = {f.name for f in fields(UnitCost)}
        extra = sorted(set(data) - known) + sorted(
            {k for unit in data.get("units", ()) for k in unit} - unit_known)
        if extra:
            raise ValueError(f"ModelProfile data has unknown keys {extra}; expected keys of "
                             f"ModelProfile {sorted(known)} and UnitCost {sorted(unit_known)}")
        units = tuple(UnitCost(**{**unit, "fqns": tuple(unit["fqns"]), "recompute": tuple(
            tuple(entry) for entry in unit.get("recompute", ()))})
            for unit in data.get("units", ()))
        rest = {k: v for k, v in data.items() if k != "units"}
        if "shared_fqns" in rest:
            rest["shared_fqns"] = tuple(rest["shared_fqns"])
        return cls(units=units, **rest)
