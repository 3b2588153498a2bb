"""Frozen stages at run time: which local stages run a backward and take input gradients.

The program already lacks the frozen stages' backward work (:mod:`pp_core.schedule.frozen`,
decided from the model as split, the same on every rank); this module tells the local
:class:`~pp_core.runtime.stage.Stage` objects what the program assumes, so that sender and
receiver agree without a message:

* a stage of the frozen prefix (``runs_backward`` false) runs its forward without an autograd
  graph and keeps nothing for a backward;
* the first trainable stage (``input_grads`` false) receives its inputs as plain tensors: it
  computes no gradient for them and sends none back, and its predecessor waits for none.

Frozen parameters get no ``.grad`` (autograd never writes one) and, in the YAML trainer, no
optimizer state (only parameters that require a gradient are handed to the optimizer).
"""

from __future__ import annotations

from typing import Optional, Sequence

from pp_core.errors import ConfigError
from pp_core.schedule.frozen import backward_from

__all__ = ["mark_frozen", "check_frozen"]


def mark_frozen(stages: dict, trainable: Optional[Sequence[bool]]) -> None:
    """Set ``runs_backward`` / ``input_grads`` of the local ``stages`` from the plan's flags."""
    if trainable is None:
        return
    start = backward_from(trainable)
    for index, stage in stages.items():
        stage.runs_backward = index >= start
        stage.input_grads = index > start
        stage.trainable = bool(trainable[index])


def check_frozen(stages: dict) -> None:
    """Refuse a step whose stages were unfrozen after the pipeline was built: the program has no
    backward (or no ``W``) for them, so their new trainable parameters would get no gradient."""
    for index, stage in stages.items():
        if getattr(stage, "trainable", True):
            continue
        names = [name for name, p in stage.module.named_parameters() if p.requires_grad]
        if names:
            shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            raise ConfigError(
                f"stage {index} was built frozen (no parameter required a gradient, so its "
                f"program has no weight gradient{'' if stage.runs_backward else ' and no backward'}"
                f"), but {shown} now require{'s' if len(names) == 1 else ''} one; freeze or "
                f"unfreeze parameters (requires_grad_, model.freeze, model.lora) before "
                f"build_pipeline, or build the pipeline again")
