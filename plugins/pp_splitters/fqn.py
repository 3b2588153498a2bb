"""The ``fqn`` splitter: stages named by hand in ``config.module_fqns_per_model_part``.

    module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]

Each inner list is one stage, in stage order; a name is a module, parameter or buffer of the
model. Every parameter must be named (through itself or a module above it) on exactly one stage.
A module without parameters that no stage names (a rotary-embedding or dropout module) is put on
every stage, where it costs nothing, so the model's forward still finds it.
"""

from __future__ import annotations

from pp_core import ConfigError, hookimpl
from pp_core.planning.units import shared_modules

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
        shared = shared_modules(model, {fqn for part in stages for fqn in part})
        return [stage + [fqn for fqn in shared if fqn not in stage] for stage in stages]


@hookimpl
def pp_register_splitters(register):
    register("fqn", FqnSplitter())
