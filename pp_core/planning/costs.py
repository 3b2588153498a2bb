"""What the planner knows about a model: measured cost and memory per unit of the split.

A *unit* is the smallest thing a splitter may place on a stage: the modules before ``layers``
(embedding) as one unit, each block of ``layers``, the modules after it (norm, head, loss) as
one unit. The profiler (``pp_core.planning.profile``) fills these from measurements on the
rank's own device; the balanced splitter and the planner read them. Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UnitCost", "ModelProfile"]


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


@dataclass(frozen=True)
class ModelProfile:
    """A model measured at one microbatch size, plus the link between ranks."""

    microbatch_size: int
    units: tuple[UnitCost, ...]    # in model order; contiguous runs of units make stages
    p2p_latency_s: float           # one small send/recv between two ranks
    p2p_bytes_per_s: float         # bandwidth of a large send/recv
    optimizer_bytes_per_param_byte: float = 2.0   # AdamW: exp_avg + exp_avg_sq

    def transfer_s(self, num_bytes: int) -> float:
        """Predicted time of one point-to-point hand-off of ``num_bytes``."""
        return self.p2p_latency_s + num_bytes / self.p2p_bytes_per_s
