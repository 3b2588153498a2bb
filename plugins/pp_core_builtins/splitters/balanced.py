"""The ``balanced`` splitter: contiguous units, cut where the measured time per stage is even.

    profiles = profile_model(model, inputs, target, loss_fn, [config.pp_microbatch_size])
    pipe = build_pipeline(model, config, splitter=BalancedSplitter(profiles))

The ``layers`` splitter balances block counts, which is not time: a large embedding or head, or
blocks of two widths, leave one stage slower than the rest, and a pipeline runs at the pace of
its slowest stage. This one moves the same units (``units(model)`` of the splitter that would
split the model anyway: ``layers``, ``hf_decoder``, ``sequential``) and balances forward +
backward seconds per stage (:func:`pp_core.planning.balance.split_by_profile`); parts are built
by that splitter too (``hf_decoder``'s stage forwards), so only the cut points change.

It never guesses: named without a profile (``splitter="balanced"``) it raises a ConfigError
naming the fix. In YAML, ``model.splitter: balanced`` makes ``pp-core run`` profile the model
once, before launch, and hand every rank the same module lists (``docs/splitting.md``).
``priority`` is the lowest, so automatic selection never picks it.
"""

from __future__ import annotations

import dataclasses

from pp_core import ConfigError, hookimpl
from pp_core.config import PipelineConfig
from pp_core.planning.balance import KINDS, split_by_profile
from pp_core.planning.units import model_units, shared_modules, unit_splitter

__all__ = ["BalancedSplitter"]

FIX = ("profile it first: BalancedSplitter(profile_model(model, inputs, target, loss_fn, "
       "[config.pp_microbatch_size])) with pp_core.measure.profile.profile_model, or in YAML "
       "set model.splitter: balanced (pp-core run profiles before launch)")


class BalancedSplitter:
    """Splits by a measured profile: a :class:`ModelProfile`, or ``profile_model``'s dict of
    them by microbatch size (the config's ``pp_microbatch_size`` picks one).

    :param kind: ``"train"`` balances forward + backward, ``"eval"`` forward only.
    :param base: the splitter (object or registered name) whose units and parts are used;
        default: the one pp-core would choose for the model.
    """

    name = "balanced"
    priority = -1000

    def __init__(self, profile=None, kind: str = "train", base=None, plugins=None):
        if kind not in KINDS:
            raise ConfigError(f"BalancedSplitter(kind={kind!r}): expected one of "
                              f"{', '.join(map(repr, KINDS))}")
        self.profile, self.kind, self.base, self.plugins = profile, kind, base, plugins
        self._busy = False  # accepts() asks the registry, which may ask accepts() again

    def _base(self, model):
        return unit_splitter(model, self.plugins, self.base)

    def accepts(self, model) -> bool:
        if self._busy:
            return False
        self._busy = True
        try:
            self._base(model)
            return True
        except ConfigError:
            return False
        finally:
            self._busy = False

    def rejection(self, model) -> str:
        return ("no splitter that lists the model's units (units(model)) accepts it; "
                "give it a `layers` ModuleList/ModuleDict")

    def num_layers(self, model) -> int:
        """The base splitter's count, so ``layers_per_stage`` gives the same number of stages."""
        _, base = self._base(model)
        counter = getattr(base, "num_layers", None)
        return counter(model) if counter is not None else len(model_units(model, self.plugins,
                                                                           self.base))

    def _profile_for(self, config):
        profile = self.profile
        if profile is None:
            raise ConfigError(f"splitter 'balanced' has no profile, and does not guess; {FIX}")
        if isinstance(profile, dict):
            size = getattr(config, "pp_microbatch_size", None)
            if size not in profile:
                raise ConfigError(f"splitter 'balanced' was given profiles for microbatch sizes "
                                  f"{sorted(profile)}, but pp_microbatch_size={size}; profile "
                                  f"that size too")
            profile = profile[size]
        return profile

    def stages(self, model, num_stages, config) -> list[list[str]]:
        """The split in ``module_fqns_per_model_part`` form (no shared modules)."""
        if config is not None and config.module_fqns_per_model_part is not None:
            raise ConfigError("module_fqns_per_model_part is set, which splitter 'balanced' "
                              "does not read; use splitter 'fqn' (the default when it is set)")
        profile = self._profile_for(config)
        units = model_units(model, self.plugins, self.base)
        measured = [unit.fqns for unit in profile.units]
        if measured != units:
            raise ConfigError(
                f"splitter 'balanced': the profile's units ({len(measured)}, from "
                f"{measured[:2]}) are not this model's ({len(units)}, from {units[:2]}); "
                f"profile this model")
        return split_by_profile(profile, num_stages, self.kind)

    def split(self, model, num_stages, config) -> list[list[str]]:
        stages = self.stages(model, num_stages, config)
        shared = shared_modules(model, {fqn for stage in stages for fqn in stage})
        return [stage + shared for stage in stages]

    def make_part(self, model, fqns, stage_index, num_stages, config):
        """The base splitter's part (its stage forwards), told the whole split; else pruned."""
        _, base = self._base(model)
        make_part = getattr(base, "make_part", None)
        if make_part is None:
            from pp_core.planning.parts import prune_model  # lazy: torch, off the plugin listing

            return prune_model(model, fqns)
        if config is None:
            config = PipelineConfig()
        stages = self.stages(model, num_stages, config)
        config = dataclasses.replace(config, module_fqns_per_model_part=stages,
                                     layers_per_stage=None, round_virtual_stages_to_pp_multiple=None)
        return make_part(model, fqns, stage_index, num_stages, config)


@hookimpl
def pp_register_splitters(register):
    register("balanced", BalancedSplitter())
