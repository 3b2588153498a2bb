"""Where the pieces of a Hugging Face vision-language model live, as units of the split.

    LlavaForConditionalGeneration                        units, in order
      model.vision_tower.embeddings, .pre_layrnorm       front
      model.vision_tower.encoder.layers.0 .. k-1         one unit per block the features use
      model.vision_tower.encoder.layers.k .., .post_layernorm, model.multi_modal_projector
                                                         projector (+ what never runs)
      model.language_model.embed_tokens                  embedding (the images merge here)
      model.language_model.layers.0 .. L-1               one unit per decoder layer
      model.language_model.norm, lm_head                 head

The vision units come before the text embedding, so a contiguous split in unit order can put the
encoder on the first stage with the first decoder layers (what torchtitan and NeMo do), on stages
of its own, or spread over several. Blocks after ``vision_feature_layer`` (LLaVA's default -2
leaves the last one) and the tower's pooler never take part in the features: they stay with the
projector unit, held but never run, as their gradients are ``None`` unsplit. The text half is
the ``hf_decoder`` layout (:func:`.layout.find_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pp_core import ConfigError
from pp_core_builtins.transformers.layout import DecoderLayout, find_layout
from pp_core_builtins.transformers.vision import VisionFamily, family_of

__all__ = ["VisionLayout", "find_vision_layout", "held_units"]

FRONT, BLOCK, PROJECTOR, EMBED, TEXT = "front", "block", "projector", "embed", "text"


@dataclass(frozen=True)
class VisionLayout:
    """The units of one VLM and the decoder layout of its text half."""

    family: VisionFamily
    decoder: DecoderLayout
    multimodal: str                  # the module holding tower, projector, text ("model")
    front: tuple[str, ...]
    blocks: tuple[str, ...]          # the blocks the features use, in order
    projector: tuple[str, ...]
    embed: tuple[str, ...]

    @property
    def tower(self) -> str:
        return f"{self.multimodal}.{self.family.tower}"

    def units(self) -> list[tuple[str, ...]]:
        return [self.front, *[(b,) for b in self.blocks], self.projector, self.embed,
                *[(fqn,) for fqn in self.decoder.layer_fqns()], self.decoder.last]

    def kinds(self) -> list[str]:
        """The kind of each unit of :meth:`units`."""
        return [FRONT, *[BLOCK] * len(self.blocks), PROJECTOR, EMBED,
                *[TEXT] * (len(self.decoder.layer_keys) + 1)]


def find_vision_layout(model) -> VisionLayout | None:
    """The :class:`VisionLayout` of a VLM of a supported family, else ``None``."""
    config = getattr(model, "config", None)
    family = family_of(config)
    if family is None:
        return None
    decoder = find_layout(model)
    multimodal = decoder.text.rpartition(".")[0]
    tower = model.get_submodule(f"{multimodal}.{family.tower}")
    names = {name for name, _ in tower.named_children()}
    base = f"{multimodal}.{family.tower}"
    front = tuple(f"{base}.{name}" for name in family.front if name in names)
    container = tower.get_submodule(family.blocks)
    keys = list(container._modules)
    used = family.used_blocks(config)
    blocks = tuple(f"{base}.{family.blocks}.{key}" for key in keys[:used])
    idle = tuple(f"{base}.{family.blocks}.{key}" for key in keys[used:]) + tuple(
        f"{base}.{name}" for name in family.after if name in names)
    own = tuple(f"{multimodal}.{name}" for name in family.projector)
    vision = front + blocks + idle + own
    embed = tuple(fqn for fqn in decoder.first
                  if fqn != base and fqn not in vision and not fqn.startswith(base + "."))
    return VisionLayout(family, decoder, multimodal, front, blocks, idle + own, embed)


def _covers(fqns, name: str) -> bool:
    return any(name == fqn or name.startswith(fqn + ".") for fqn in fqns)


def held_units(layout: VisionLayout, fqns, where: str) -> list[int]:
    """The units (indices into :meth:`VisionLayout.units`) a stage holding ``fqns`` holds: a
    contiguous run, each unit whole; ConfigError naming ``where`` otherwise."""
    held = []
    for index, unit in enumerate(layout.units()):
        covered = [_covers(fqns, name) for name in unit]
        if all(covered):
            held.append(index)
        elif any(covered):
            missing = [name for name, c in zip(unit, covered) if not c]
            raise ConfigError(f"{where} holds part of the unit {list(unit)} but not {missing}; "
                              f"a stage holds each unit whole (docs/transformers.md, "
                              f"Vision-language models)")
    if held and held != list(range(held[0], held[-1] + 1)):
        raise ConfigError(f"{where} holds units that do not follow each other ({held}); a stage "
                          f"holds a contiguous run of the model's units, vision first")
    return held


def check_stage_order(layout: VisionLayout, stages, source: str) -> None:
    """Every stage a contiguous run of units, the runs in order (the carry protocol needs it)."""
    last = -1
    for index, fqns in enumerate(stages):
        held = held_units(layout, fqns, f"{source}: stage {index}")
        if not held:
            continue
        if held[0] != last + 1:
            raise ConfigError(f"{source}: stage {index} starts at unit {held[0]} "
                              f"({list(layout.units()[held[0]])[:2]}) but the stages before end "
                              f"at unit {last}; stages follow the model's units in order, "
                              f"vision first")
        last = held[-1]
