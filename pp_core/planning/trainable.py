"""Which stages of a split hold something to train: the flags the frozen-stage pass reads.

A stage is trainable when a parameter it holds (under any of the FQNs its split names: a module,
a parameter, or a parent of either) requires a gradient. Read from the model as
``build_pipeline`` gets it - real or on the meta device, frozen by ``requires_grad_(False)``,
``model.freeze`` or PEFT - so every rank (and ``pp-core validate``) computes the same flags
without a collective. Freeze before building the pipeline: the program is fixed then
(:func:`pp_core.runtime.frozen.check_frozen` refuses a stage unfrozen afterwards).
"""

from __future__ import annotations

__all__ = ["stage_trainable"]


def stage_trainable(model, fqns_per_stage) -> tuple[bool, ...]:
    """Per stage, whether one of its parameters requires a gradient."""
    prefixes = [tuple(fqns) for fqns in fqns_per_stage]
    flags = [False] * len(prefixes)
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        for stage, fqns in enumerate(prefixes):
            if not flags[stage] and any(name == f or name.startswith(f + ".") for f in fqns):
                flags[stage] = True
    return tuple(flags)
