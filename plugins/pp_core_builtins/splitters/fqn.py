"""The ``fqn`` splitter: stages named by hand in ``config.module_fqns_per_model_part``.

    module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]

Each inner list is one stage, in stage order; a name is a module, parameter or buffer of the
model. Every parameter must be named (through itself or a module above it) on exactly one stage.
A module without parameters that no stage names (a rotary-embedding or dropout module) is put on
every stage, where it costs nothing, so the model's forward still finds it.
"""

from __future__ import annotations

from pp_core import ConfigError, hookimpl

__all__ = ["FqnSplitter"]


class FqnSplitter:
    """Takes the split verbatim from the config; chosen first whenever that field is set."""

    name = "fqn"
    priority = 300

    def accepts(self, model, config) -> bool:
        return config is not None and config.module_fqns_per_model_part is not None

    def rejection(self, model) -> str:
        return "module_fqns_per_model_part is not set"

    def split(self, model, num_stages, config) -> list[list[str]]:
        parts = config.module_fqns_per_model_part if config is not None else None
        if not parts:
            raise ConfigError("splitter 'fqn' needs module_fqns_per_model_part, e.g. "
                              "[['embed', 'layers.0'], ['layers.1', 'norm', 'output']]")
        if len(parts) != num_stages:
            raise ConfigError(
                f"module_fqns_per_model_part has {len(parts)} parts but the pipeline has "
                f"{num_stages} stages; give exactly {num_stages} lists of module names")
        stages = [list(part) for part in parts]
        shared = _unnamed_parameter_free(model, {fqn for part in stages for fqn in part})
        return [stage + [fqn for fqn in shared if fqn not in stage] for stage in stages]


def _unnamed_parameter_free(model, named: set[str]) -> list[str]:
    """The top-most modules that hold no parameter and are neither named nor above a name."""
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


@hookimpl
def pp_register_splitters(register):
    register("fqn", FqnSplitter())
