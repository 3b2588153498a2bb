"""The stage forward of a vision-language model's parts: images in, the decoder's carry out.

A pipeline is a chain, so every stage before the one holding the text embedding hands on, beside
its vision state, what the stages after it need of the microbatch - the *vision carry*, five
tensors, the same on every such boundary:

    (state, input_ids, position_ids, media, attention_mask)

``state`` is the pixels before the tower's front, its hidden states between blocks, the image
features after the projector (one row per placeholder token); ``media`` the per-image sizes
(:meth:`VisionFamily.media`); ``attention_mask`` an empty tensor when the batch has none. The
stage holding the embedding scatters the features into the placeholders' embeddings and goes on
as the text decoder does, handing on ``(hidden, position_ids[, attention_mask])``
(:mod:`.forward`). Shapes differ per microbatch (images per sample vary) and cross as they are:
every forward message announces its shapes. A microbatch without images runs no vision work at
all: its empty state passes through untouched, with no gradient, so its backward is empty too.

The first stage takes the microbatch dict: ``input_ids``, ``attention_mask``, ``pixel_values``
and the family's media keys (``image_sizes``; ``image_grid_thw`` and ``mm_token_type_ids``).
``position_ids`` are made there when not given - the text positions, or Qwen2-VL's 3-D rotary
positions from ``get_rope_index`` - and travel to every decoder stage.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

from pp_core_builtins.transformers.forward import (DecoderAdapter, causal_lm_stage_forward,
                                                   held_module)
from pp_core_builtins.transformers.media import image_token_id
from pp_core_builtins.transformers.vision_layout import (BLOCK, EMBED, FRONT, PROJECTOR,
                                                         VisionLayout)

__all__ = ["VisionStage", "patch_vision_stage"]


@dataclass(frozen=True)
class VisionStage:
    """What one part does of the vision half: the kinds of the units it holds, in order."""

    kinds: tuple[str, ...]

    @property
    def first(self) -> bool:
        return FRONT in self.kinds

    @property
    def vision(self) -> bool:
        """Whether the part runs anything before the text decoder (else it is a text part)."""
        return any(kind in (FRONT, BLOCK, PROJECTOR, EMBED) for kind in self.kinds)


def _first_inputs(family, args, kwargs) -> dict:
    if args:
        raise TypeError(f"the first stage of a vision-language model takes the microbatch as a "
                        f"dict ({', '.join(family.inputs)}), got {len(args)} positional values")
    unknown = sorted(set(kwargs) - set(family.inputs))
    if unknown:
        raise TypeError(f"the first pipeline stage got unexpected inputs {unknown}; a "
                        f"{family.name} microbatch may hold {', '.join(family.inputs)} (labels "
                        f"go to the step's target)")
    if not isinstance(kwargs.get("input_ids"), torch.Tensor):
        raise TypeError("the first stage of a vision-language model needs input_ids (the "
                        "placeholders say where each image goes)")
    return kwargs


def _positions(multimodal, family, inputs, input_ids) -> torch.Tensor:
    """The decoder's position ids: given, Qwen2-VL's 3-D rotary positions, or 0..S-1."""
    given = inputs.get("position_ids")
    if given is not None:
        return given
    types_ = inputs.get("mm_token_type_ids")
    if family.name == "qwen2_vl" and types_ is not None:
        grid = family.media(inputs)
        return multimodal.get_rope_index(input_ids, types_, image_grid_thw=grid,
                                          attention_mask=inputs.get("attention_mask"))[0]
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)


def _carry_from_inputs(multimodal, family, args, kwargs) -> tuple:
    """The first stage's microbatch as the vision carry (the mask ``None`` when absent)."""
    inputs = _first_inputs(family, args, kwargs)
    input_ids = inputs["input_ids"]
    pixels = inputs.get("pixel_values")
    return (pixels if pixels is not None else torch.zeros(0, device=input_ids.device), input_ids,
            _positions(multimodal, family, inputs, input_ids),
            family.media(inputs).to(input_ids.device), inputs.get("attention_mask"))


def _carry_from_previous(args, kwargs) -> tuple:
    if kwargs or len(args) != 5:
        raise TypeError(f"a vision stage takes the vision carry (state, input_ids, "
                        f"position_ids, media, attention_mask) from the stage before, got "
                        f"{len(args)} positional and {sorted(kwargs)} keyword inputs")
    state, input_ids, position_ids, media, mask = args
    return state, input_ids, position_ids, media, (mask if mask.numel() else None)


def _run_vision(root, layout: VisionLayout, stage: VisionStage, multimodal, state, media):
    """This part's share of the vision half: the front, its blocks, the projector."""
    family, config = layout.family, root.config
    tower = multimodal._modules.get(family.tower)
    if FRONT in stage.kinds:
        state = family.begin(tower, state, media, config)
    if BLOCK in stage.kinds:
        context = family.context(tower, state, media)
        for layer in filter(None, (held_module(root, name) for name in layout.blocks)):
            state = family.block(layer, state, context)
    if PROJECTOR in stage.kinds:
        state = family.project(multimodal, state, media, config)
    return state


def _merged(root, layout: VisionLayout, adapter, input_ids, features) -> torch.Tensor:
    """The text embeddings with the image features scattered into their placeholders."""
    embeds = adapter.embed(root.get_submodule(layout.decoder.text), input_ids)
    placeholders = input_ids == image_token_id(root.config)
    found, rows = int(placeholders.sum()), features.shape[0] if features.dim() else 0
    if found != rows:
        raise ValueError(f"this microbatch holds {found} image placeholder tokens but its images "
                         f"give {rows} feature rows; the processor and the model disagree "
                         f"(image size, patch size, vision_feature_select_strategy)")
    if not rows:
        return embeds
    return embeds.masked_scatter(placeholders.unsqueeze(-1),
                                 features.to(embeds.device, embeds.dtype))


def vision_stage_forward(self, *args, layout: VisionLayout, stage: VisionStage,
                         adapter: DecoderAdapter, **kwargs):
    """The patched root forward of a part holding vision units or the text embedding."""
    multimodal = self.get_submodule(layout.multimodal)
    carry = _carry_from_inputs(multimodal, layout.family, args, kwargs) if stage.first else \
        _carry_from_previous(args, kwargs)
    state, input_ids, position_ids, media, mask = carry
    if state.dim() and state.shape[0]:  # a microbatch without images runs no vision work
        state = _run_vision(self, layout, stage, multimodal, state, media)
    if EMBED not in stage.kinds:
        empty = torch.zeros(0, dtype=torch.long, device=input_ids.device)
        return state, input_ids, position_ids, media, (mask if mask is not None else empty)
    return causal_lm_stage_forward(self, inputs_embeds=_merged(self, layout, adapter, input_ids,
                                                               state),
                                   attention_mask=mask, position_ids=position_ids,
                                   text_name=layout.decoder.text,
                                   head_name=layout.decoder.head, adapter=adapter)


def patch_vision_stage(part: nn.Module, layout: VisionLayout, stage: VisionStage,
                       adapter: DecoderAdapter) -> None:
    """Give a part holding vision units (or the embedding) the vision stage forward."""
    forward = functools.partial(vision_stage_forward, layout=layout, stage=stage, adapter=adapter)
    part.forward = types.MethodType(forward, part)
