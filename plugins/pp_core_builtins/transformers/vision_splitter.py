"""The ``hf_vision_language`` splitter: Hugging Face vision-language models, images included.

    split(LlavaForConditionalGeneration with 4 decoder layers, num_stages=2)
    stage 0: model.vision_tower  model.multi_modal_projector  model.language_model.embed_tokens
             model.language_model.layers.0  model.language_model.layers.1   (+ rotary tables)
    stage 1: model.language_model.layers.2  layers.3  model.language_model.norm  lm_head

Without a cost to go by, the split is the anchors' (torchtitan's ``pipeline_with_first_stage_
modules``, NeMo AutoModel's): the whole vision half on the first stage, the decoder layers spread
evenly - ``layers_per_stage`` counts decoder layers. ``module_fqns_per_model_part``, the
``balanced`` splitter and ``pp_schedule: auto`` move the vision units (:mod:`.vision_layout`)
like any other: a stage of their own, or spread over several. Each part gets the vision stage
forward (:mod:`.vision_forward`) where it holds vision units or the embedding, the decoder's
stage forwards elsewhere (:mod:`.forward`), and the media seam (:mod:`.media`) always.
``priority`` 410: ahead of ``hf_decoder``, which would split the text half only.
"""

from __future__ import annotations

from pp_core import ConfigError
from pp_core.planning.units import shared_modules
from pp_core_builtins.transformers.layout import plan_stages
from pp_core_builtins.transformers.media import bind_media_seam
from pp_core_builtins.transformers.splitter import HFDecoderSplitter, is_hf_model
from pp_core_builtins.transformers.vision import FAMILIES, family_of
from pp_core_builtins.transformers.vision_forward import VisionStage, patch_vision_stage
from pp_core_builtins.transformers.vision_layout import (check_stage_order, find_vision_layout,
                                                         held_units)

__all__ = ["HFVisionLanguageSplitter"]


class HFVisionLanguageSplitter(HFDecoderSplitter):
    """Splits HF vision-language models of the families in :data:`.vision.FAMILIES`."""

    name = "hf_vision_language"
    priority = 410

    def accepts(self, model) -> bool:
        if not is_hf_model(model):
            return False
        try:
            return family_of(model.config) is not None and super().accepts(model)
        except ConfigError:  # a tower this plugin cannot run in pieces
            return False

    def rejection(self, model) -> str:
        config = getattr(model, "config", None)
        try:
            family_of(config)
        except ConfigError as exc:
            return str(exc)
        return (f"not a vision-language model of a supported family ({', '.join(FAMILIES)}; "
                f"model_type {getattr(config, 'model_type', None)!r})")

    def num_layers(self, model) -> int:
        return len(find_vision_layout(model).decoder.layer_keys)

    def units(self, model) -> list[tuple[str, ...]]:
        """The tower's front, each block the features use, the projector, the embedding, each
        decoder layer, norm and head (:class:`.vision_layout.VisionLayout`)."""
        return find_vision_layout(model).units()

    def split(self, model, num_stages, config) -> list[list[str]]:
        layout = find_vision_layout(model)
        fixed = getattr(config, "module_fqns_per_model_part", None)
        if fixed is None:
            stages = [[fqn for fqn in stage if fqn not in layout.decoder.shared]
                      for stage in plan_stages(layout.decoder, num_stages)]
            source = f"splitter {self.name!r}"
        else:
            if len(fixed) != num_stages:
                raise ConfigError(
                    f"module_fqns_per_model_part has {len(fixed)} parts but the pipeline has "
                    f"{num_stages} stages; give exactly {num_stages} lists of module names")
            stages = [list(part) for part in fixed]
            source = "module_fqns_per_model_part"
        check_stage_order(layout, stages, source)
        embed = layout.kinds().index("embed")
        if getattr(config, "pp_seq_len", None) is not None and \
                embed not in held_units(layout, stages[0], f"{source}: stage 0"):
            raise ConfigError(
                f"pipeline.pp_seq_len={config.pp_seq_len} fixes the shapes stages send, but "
                f"this split hands the vision carry from stage to stage before the embedding, "
                f"whose shapes change with the images of each microbatch; unset pp_seq_len, or "
                f"keep the vision half on stage 0")
        shared = shared_modules(model, {fqn for stage in stages for fqn in stage})
        return [stage + [fqn for fqn in shared if fqn not in stage] for stage in stages]

    def make_part(self, model, fqns, stage_index, num_stages, config):
        layout = find_vision_layout(model)
        part = super().make_part(model, fqns, stage_index, num_stages, config)
        kinds = layout.kinds()
        stage = VisionStage(tuple(kinds[i] for i in held_units(layout, fqns,
                                                                f"stage {stage_index}")))
        if stage.vision:
            patch_vision_stage(part, layout, stage, self.adapter(model))
        bind_media_seam(part, layout.family)
        return part
