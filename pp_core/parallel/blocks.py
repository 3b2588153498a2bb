"""The blocks of a model part that activation checkpointing and compilation act on.

A *block* is one entry of the part's ``layers`` container (the ``layers`` splitter's contract,
docs/splitting.md; for Hugging Face models the decoder layers under ``model.layers``), or, for an
``nn.Sequential`` part (the ``sequential`` splitter), each of its children. Blocks keep their
names: the FQN of a block is the same in the part and in the unsplit model.
"""

from __future__ import annotations

from torch import nn

from pp_core.errors import ConfigError

__all__ = ["find_blocks"]

_LAYERS = (nn.ModuleList, nn.ModuleDict)


def find_blocks(part: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(fqn, block)]`` in forward order; a part without blocks is a :class:`ConfigError`."""
    for name, module in part.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, _LAYERS):
            prefix = f"{name}."
            return [(prefix + key, block) for key, block in module._modules.items()
                    if block is not None]
    if isinstance(part, nn.Sequential):
        return [(key, block) for key, block in part._modules.items() if block is not None]
    raise ConfigError(
        f"a model part of type {type(part).__name__} has no blocks to checkpoint or compile: "
        f"pp_core.parallel acts on the entries of a `layers` ModuleList/ModuleDict (the "
        f"'layers' splitter's contract, HF decoder layers) or the children of an nn.Sequential; "
        f"give the model a `layers` container, or wrap its modules yourself in place "
        f"(torch.utils.checkpoint, module.compile())")


def block_index(fqn: str) -> int | None:
    """The position of a block in its container when its key is a number (``layers.3`` -> 3)."""
    key = fqn.rsplit(".", 1)[-1]
    return int(key) if key.isdigit() else None
