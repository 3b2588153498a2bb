"""How each family of Hugging Face vision-language models runs its vision half in pieces.

A VLM's forward embeds the text, runs the vision tower on the images, projects its features to
the text width and scatters them into the image placeholders' embeddings. On a pipeline that
half is cut into units (the tower's front, each block, the projector) that may land on any
stage, so each step is a method here, computing exactly what the model's own
``get_image_features`` computes:

    begin(tower, pixels, media)         pixels -> the first block's input
    context(tower, media)               what every block needs besides the hidden states
    block(layer, hidden, context)       one block
    project(model, hidden, media)       the features, one row per placeholder token, in order

``media`` is the int64 tensor of per-image sizes that travels with the images (LLaVA-NeXT's
``image_sizes``, Qwen2-VL's ``image_grid_thw``; empty for LLaVA). Families:

* ``llava``, ``llava_next``: a CLIP or SigLIP tower (``embeddings``, ``pre_layrnorm``,
  ``encoder.layers``), ``vision_feature_layer`` (one layer; the blocks after it never run),
  ``vision_feature_select_strategy``, the projector; LLaVA-NeXT tiles each image (any
  resolution: a base tile and a grid), unpads and adds ``image_newline`` per row, so the token
  count varies per image.
* ``qwen2_vl``: ``visual`` (``patch_embed``, ``blocks`` with a vision rotary table and one
  attention window per image, ``merger``) and 3-D rotary positions (``get_rope_index``) every
  decoder stage needs.

:func:`image_tokens` says how many placeholder tokens each image of a batch fills: the media
seam (:mod:`.media`) and the checks use it. Nothing here imports ``transformers`` at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pp_core import ConfigError

__all__ = ["VisionFamily", "family_of", "FAMILIES", "SUPPORTED_TOWERS"]

SUPPORTED_TOWERS = ("clip_vision_model", "siglip_vision_model")
"""The vision towers of the LLaVA families this plugin runs in pieces."""


@dataclass(frozen=True)
class VisionFamily:
    """One family: where its vision half lives and how each piece of it runs.

    ``tower`` and ``projector`` are names under the model's multimodal module (``model``);
    ``front``, ``blocks`` and ``after`` under the tower; ``media_keys`` are the inputs cut by
    sample.
    """

    name: str
    tower: str
    front: tuple[str, ...]
    blocks: str
    after: tuple[str, ...]       # tower modules the model never runs (a pooler, a final norm)
    projector: tuple[str, ...]   # the projector unit's own names (beside the idle blocks)
    media_keys: tuple[str, ...]
    inputs: tuple[str, ...]      # every key a first stage accepts

    # ------------------------------------------------------------------ config
    def used_blocks(self, config) -> int:
        """The blocks whose output the features use (LLaVA's ``vision_feature_layer``)."""
        depth = _depth(config.vision_config)
        if self.name == "qwen2_vl":
            return depth
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ConfigError(
                f"{self.name}: vision_feature_layer={layer!r} selects several layers, which "
                f"pp-core does not run in pieces yet; use one layer (an int, e.g. -2)")
        if not -(depth + 1) <= layer <= depth:
            raise ConfigError(f"{self.name}: vision_feature_layer={layer} is outside the tower's "
                              f"{depth} layers")
        return layer % (depth + 1)  # hidden state i is the output of i blocks

    # ------------------------------------------------------------------ the pieces
    def begin(self, tower: nn.Module, pixels: torch.Tensor, media: torch.Tensor, config):
        if self.name == "qwen2_vl":
            return tower.patch_embed(pixels.type(tower.patch_embed.proj.weight.dtype))
        if self.name == "llava_next":
            pixels = _next_tiles(pixels, media, config)
        hidden = tower.embeddings(pixels)
        norm = tower._modules.get("pre_layrnorm")
        return norm(hidden) if norm is not None else hidden

    def context(self, tower: nn.Module, hidden: torch.Tensor, media: torch.Tensor) -> dict:
        if self.name != "qwen2_vl":
            return {}
        from transformers.vision_utils import (  # lazy: transformers, seconds to import
            get_vision_attention_seqlens, get_vision_position_ids)

        positions = get_vision_position_ids(media, tower.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(media, tower.config)
        return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
                "position_embeddings": tower.rotary_pos_emb(hidden, positions)}

    def block(self, layer: nn.Module, hidden: torch.Tensor, context: dict) -> torch.Tensor:
        if self.name == "qwen2_vl":
            return layer(hidden, **context)
        return layer(hidden, None)

    def project(self, model: nn.Module, hidden: torch.Tensor, media: torch.Tensor, config):
        """The image features, ``[placeholder tokens, text width]`` (``model``: the part's
        multimodal module, holding the projector)."""
        if self.name == "qwen2_vl":
            return model.visual.merger(hidden)
        if config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        features = model.multi_modal_projector(hidden)
        if self.name == "llava":
            return features.reshape(-1, features.shape[-1])
        from transformers.models.llava_next.modeling_llava_next import (  # lazy: transformers
            image_size_to_num_patches)

        tiles = [image_size_to_num_patches(size, config.image_grid_pinpoints,
                                           config.vision_config.image_size) for size in media]
        packed, _ = model.pack_image_features(
            torch.split(features, tiles, dim=0), media, config.vision_feature_select_strategy,
            image_newline=model.image_newline)
        return torch.cat(packed, dim=0)

    # ------------------------------------------------------------------ media
    def media(self, inputs: dict) -> torch.Tensor:
        """The per-image sizes that travel with the images (empty for LLaVA)."""
        key = {"llava_next": "image_sizes", "qwen2_vl": "image_grid_thw"}.get(self.name)
        found = inputs.get(key) if key else None
        if found is None:
            return torch.zeros((0, 3 if self.name == "qwen2_vl" else 2), dtype=torch.long)
        return found.to(torch.long)

    def image_tokens(self, config, media: torch.Tensor, images: int) -> torch.Tensor:
        """The placeholder tokens each of ``images`` images fills, ``[images]`` int64."""
        if self.name == "qwen2_vl":
            return media.prod(-1) // config.vision_config.spatial_merge_size ** 2
        if self.name == "llava":
            return torch.full((images,), _llava_tokens(config), dtype=torch.long)
        return torch.tensor([_next_tokens(config, size) for size in media.tolist()],
                            dtype=torch.long)

    def rows(self, media: torch.Tensor, key: str) -> torch.Tensor:
        """Rows of input ``key`` per image: one, or Qwen2-VL's patches of each image."""
        if self.name == "qwen2_vl" and key == "pixel_values":
            return media.prod(-1)
        return torch.ones(media.shape[0], dtype=torch.long)


def _depth(vision_config) -> int:
    return getattr(vision_config, "depth", None) or vision_config.num_hidden_layers


def _llava_tokens(config) -> int:
    vision = config.vision_config
    positions = (vision.image_size // vision.patch_size) ** 2
    if vision.model_type == "clip_vision_model":
        positions += 1  # the class embedding
    return positions - (1 if config.vision_feature_select_strategy == "default" else 0)


def _next_tokens(config, size) -> int:
    """LLaVA-NeXT's placeholder tokens for an image of ``size`` (h, w): the base tile's features,
    then the grid's, unpadded to the image's aspect, one ``image_newline`` per row."""
    from transformers.models.llava_next.modeling_llava_next import (  # lazy: transformers
        get_anyres_image_grid_shape, unpad_image)

    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    rows, cols = get_anyres_image_grid_shape(size, config.image_grid_pinpoints, vision.image_size)
    grid = unpad_image(torch.empty((1, rows * side, cols * side), device="meta"), size)
    return side * side + grid.shape[1] * (grid.shape[2] + 1)


def _next_tiles(pixels: torch.Tensor, sizes: torch.Tensor, config) -> torch.Tensor:
    """LLaVA-NeXT's ``[images, max tiles, C, H, W]`` pixels as ``[tiles, C, H, W]``: each
    image's own tiles, the padding tiles left out (as ``get_image_features`` does)."""
    from transformers.models.llava_next.modeling_llava_next import (  # lazy: transformers
        image_size_to_num_patches)

    if pixels.dim() == 4:
        return pixels
    counts = [image_size_to_num_patches(size, config.image_grid_pinpoints,
                                        config.vision_config.image_size) for size in sizes]
    return torch.cat([tiles[:count] for tiles, count in zip(pixels, counts)], dim=0)


_LLAVA_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values")

FAMILIES = {
    "llava": VisionFamily("llava", "vision_tower", ("embeddings", "pre_layrnorm"),
                          "encoder.layers", ("post_layernorm", "head"),
                          ("multi_modal_projector",), ("pixel_values",), _LLAVA_INPUTS),
    "llava_next": VisionFamily("llava_next", "vision_tower", ("embeddings", "pre_layrnorm"),
                               "encoder.layers", ("post_layernorm", "head"),
                               ("multi_modal_projector", "image_newline"),
                               ("pixel_values", "image_sizes"), _LLAVA_INPUTS + ("image_sizes",)),
    "qwen2_vl": VisionFamily("qwen2_vl", "visual", ("patch_embed",), "blocks", (),
                             ("visual.merger",),
                             ("pixel_values", "image_grid_thw"),
                             _LLAVA_INPUTS + ("image_grid_thw", "mm_token_type_ids")),
}
"""The families by ``model_type``; the docs (docs/transformers.md) name each one."""


def family_of(config) -> VisionFamily | None:
    """The family of a model's config, or ``None`` (not a VLM this plugin runs in pieces)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.name != "qwen2_vl":
        tower = getattr(getattr(config, "vision_config", None), "model_type", None)
        if tower not in SUPPORTED_TOWERS:
            raise ConfigError(f"{family.name} with a {tower!r} vision tower is not supported "
                              f"(towers: {', '.join(SUPPORTED_TOWERS)})")
    return family
