"""The units of a model: the smallest pieces a cost-balancing splitter may put on a stage.

Which modules make a unit is the splitter's knowledge, not the planner's: a splitter that can be
balanced by cost says so with a ``units(model) -> list[tuple[str, ...]]`` method (``layers``:
the modules before ``layers`` with the root's parameters, each block, the modules after;
``hf_decoder``: embedding, each decoder layer, norm and head; ``sequential``: each child).
:func:`model_units` asks the splitter that would split the model anyway, so a unit never cuts
across what that splitter keeps together. Parameter-free modules no unit names (a rotary table)
belong to every stage: :func:`shared_modules`.
"""

from __future__ import annotations

from pp_core.errors import ConfigError
from pp_core.planning.split import select_splitter

__all__ = ["model_units", "unit_splitter", "shared_modules"]


def unit_splitter(model, plugins=None, splitter=None) -> tuple[str, object]:
    """``(name, splitter)`` whose ``units`` define the model's units; ConfigError if none.

    The splitter is the one pp-core would choose for the model (:func:`select_splitter`, no
    config), or the one named; it must define ``units``.
    """
    name, chosen = select_splitter(model, None, plugins, splitter)
    if not callable(getattr(chosen, "units", None)):
        raise ConfigError(
            f"splitter {name!r} cannot list the units of {type(model).__name__} (it has no "
            f"units(model) method), so the model cannot be split by measured cost; give the "
            f"model a `layers` ModuleList (docs/splitting.md), or split it by hand with "
            f"module_fqns_per_model_part")
    return name, chosen


def model_units(model, plugins=None, splitter=None) -> list[tuple[str, ...]]:
    """The model's units in model order, each a tuple of module (or parameter) FQNs."""
    name, chosen = unit_splitter(model, plugins, splitter)
    units = [tuple(unit) for unit in chosen.units(model)]
    if not units or not all(units):
        raise ConfigError(f"splitter {name!r} found no units in {type(model).__name__} "
                          f"(got {units[:4]}); a model needs at least one block to be split")
    return units


def shared_modules(model, named) -> list[str]:
    """The top-most parameter-free modules that are neither named nor above a name.

    Such a module (rotary embedding, dropout) costs nothing to hold, so it goes to every stage
    and the model's forward still finds it wherever it runs.
    """
    named = set(named)
    above = set()
    for fqn in named:
        pieces = fqn.split(".")
        above.update(".".join(pieces[:end]) for end in range(1, len(pieces)))
    found = []

    def visit(module, prefix):
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in named:
                continue
            if fqn in above:
                visit(child, fqn + ".")
            elif next(child.parameters(), None) is None:
                found.append(fqn)

    visit(model, "")
    return found
