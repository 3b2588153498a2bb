"""One step's mutable state: every tensor and bookkeeping entry the executor's actions hand on.

:meth:`pp_core.runtime.executor.Executor.run` makes a :class:`StepState` for each step and
passes it to every action's handler (the compute handlers of the executor and the SEND/RECV
handlers of :mod:`pp_core.runtime.transfers`); what lasts from one step to the next (the shapes
each stage boundary carried, the mailbox, the stages) is not in it. A failed step ends by
:meth:`StepState.clear`: nothing the step made is held after that.

Keys: ``stage * num_microbatches + microbatch``; a gradient receive is ``-1 - key`` in
``messages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["StepState"]

# the dicts a finished step must have emptied (what is left is work the program did not do)
_WORK = ("inputs", "outputs", "to_send", "messages", "grads_back", "weight", "slice_kept",
         "slice_read")


@dataclass(eq=False)
class StepState:
    """The tensors and bookkeeping of one step (training) or one forward pass (evaluation)."""

    num_microbatches: int
    mb_inputs: Optional[list] = None   # per microbatch: the first stage's inputs
    mb_targets: Optional[list] = None  # per microbatch: the loss's targets
    mb_kwargs: Optional[list] = None   # per microbatch: keyword inputs of every stage
    token_count: Any = None            # a token-normalised loss: the step's valid-token count
    token_factor: float = 1.0          # ... and M * D (pp_core.runtime.token_loss)
    early_receives: bool = False       # receives posted before their RECV (tag-matching backends)
    aux_loss_scale: float = 1.0        # what an auxiliary loss's gradient is scaled by (as the loss)
    inputs: dict = field(default_factory=dict)      # key -> stage inputs needing grad
    outputs: dict = field(default_factory=dict)     # key -> outputs needing grad (scaled loss last)
    to_send: dict = field(default_factory=dict)     # key -> outputs for SEND_F / local hand-off
    layouts: dict = field(default_factory=dict)     # key -> DTensor placements of those outputs
    messages: dict = field(default_factory=dict)    # RECV_F keys (>= 0), RECV_B keys (< 0)
    grads_back: dict = field(default_factory=dict)  # key -> input grads for SEND_B / local
    weight: dict = field(default_factory=dict)      # key -> what I kept for its W
    slice_store: dict = field(default_factory=dict)  # (stage, mb) -> prefix caches (seq_slices)
    slice_kept: dict = field(default_factory=dict)  # key -> (tensor, leaf) made for later slices
    slice_read: dict = field(default_factory=dict)  # key -> earlier slices' leaves it read
    losses: list = field(default_factory=list)      # by microbatch (the last stage's)
    results: list = field(default_factory=list)     # by microbatch: outputs without a loss
    probed: set = field(default_factory=set)        # pp_seq_len: boundaries this step sent on
    recv_probed: set = field(default_factory=set)   # ... and received on
    preposted: set = field(default_factory=set)     # positions of forward receives posted early
    preposted_b: set = field(default_factory=set)   # keys of gradient receives posted early
    pending_release: list = field(default_factory=list)  # (sends issued, buffer index)
    position: int = 0                  # the index of the running action in the program
    current: Any = None                # the running action, for error messages

    def __post_init__(self):
        if not self.losses:
            self.losses = [None] * self.num_microbatches
        if not self.results:
            self.results = [None] * self.num_microbatches

    def leftovers(self) -> list[str]:
        """The names of the work dicts a step left non-empty."""
        return [name for name in _WORK if getattr(self, name)]

    def finish(self) -> tuple[list, list]:
        """``(losses, outputs)`` of the finished step; drops its inputs and results."""
        losses = [loss for loss in self.losses if loss is not None]
        outputs = [out for out in self.results if out is not None]
        self.mb_inputs = self.mb_targets = self.mb_kwargs = self.token_count = None
        self.losses, self.results = [], []
        return losses, outputs

    def clear(self) -> None:
        """Drop every tensor and pending entry of the step (a failed step ends here)."""
        for name in _WORK + ("layouts", "slice_store"):
            getattr(self, name).clear()
        self.finish()
        self.pending_release = []
        self.current = None
