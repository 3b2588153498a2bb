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

:meth:`VisionFamily.image_tokens` says how many placeholder tokens each image of a batch fills:
the media seam (:mod:`.media`) reads it. One class per family (LLaVA's is the base, the others
override what differs); nothing here imports ``transformers`` at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pp_core import ConfigError

__all__ = ["VisionFamily", "LlavaNextFamily", "Qwen2VLFamily", "family_of", "FAMILIES",
           "SUPPORTED_TOWERS"]

SUPPORTED_TOWERS = ("clip_vision_model", "siglip_vision_model")
"""The vision towers of the LLaVA families this plugin runs in pieces."""


@dataclass(frozen=True)
class VisionFamily:
    """One family: where its vision half lives and how each piece of it runs (LLaVA's here, with
    a CLIP or SigLIP tower; the other families override what differs).

    ``tower`` and ``projector`` are names under the model's multimodal module (``model``);
    ``front``, ``blocks`` and ``after`` under the tower; ``media_keys`` are the inputs cut by
    sample; ``media_key`` the per-image sizes that travel with the images.
    """

    name: str
    tower: str = "vision_tower"
    front: tuple[str, ...] = ("embeddings", "pre_layrnorm")
    blocks: str = "encoder.layers"
    after: tuple[str, ...] = ("post_layernorm", "head")  # tower modules the model never runs
    projector: tuple[str, ...] = ("multi_modal_projector",)  # the projector unit's own names
    media_keys: tuple[str, ...] = ("pixel_values",)
    inputs: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids", "pixel_values")
    media_key: str | None = None
    media_width: int = 2

    def used_blocks(self, config) -> int:
        """The blocks whose output the features use (``vision_feature_layer``)."""
        depth = config.vision_config.num_hidden_layers
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
        hidden = tower.embeddings(pixels)
        norm = tower._modules.get("pre_layrnorm")
        return norm(hidden) if norm is not None else hidden

    def context(self, tower: nn.Module, hidden: torch.Tensor, media: torch.Tensor) -> dict:
        return {}

    def block(self, layer: nn.Module, hidden: torch.Tensor, context: dict) -> torch.Tensor:
        return layer(hidden, None, **context)

    def project(self, model: nn.Module, hidden: torch.Tensor, media: torch.Tensor, config):
        """The image features, ``[placeholder tokens, text width]`` (``model``: the part's
        multimodal module, holding the projector)."""
        features = model.multi_modal_projector(_selected(hidden, config))
        return features.reshape(-1, features.shape[-1])

    # ------------------------------------------------------------------ media
    def media(self, inputs: dict) -> torch.Tensor:
        """The per-image sizes that travel with the images (``[images, width]``; LLaVA's: none)."""
        found = inputs.get(self.media_key) if self.media_key else None
        if found is None:
            return torch.zeros((0, self.media_width), dtype=torch.long)
        return found.to(torch.long)

    def image_count(self, inputs: dict) -> int:
        pixels = inputs.get("pixel_values")
        return 0 if pixels is None else pixels.shape[0]

    def image_tokens(self, config, media: torch.Tensor, images: int) -> torch.Tensor:
        """The placeholder tokens each of ``images`` images fills, ``[images]`` int64."""
        vision = config.vision_config
        positions = (vision.image_size // vision.patch_size) ** 2
        if vision.model_type == "clip_vision_model":
            positions += 1  # the class embedding
        drop = 1 if config.vision_feature_select_strategy == "default" else 0
        return torch.full((images,), positions - drop, dtype=torch.long)

    def rows(self, media: torch.Tensor, key: str) -> torch.Tensor | None:
        """Rows of input ``key`` per image (``None``: one each)."""
        return None


def _selected(hidden: torch.Tensor, config) -> torch.Tensor:
    """``vision_feature_select_strategy``: ``default`` drops the first (class) token."""
    return hidden[:, 1:] if config.vision_feature_select_strategy == "default" else hidden


def _tiles(config, sizes) -> list[int]:
    from transformers.models.llava_next.modeling_llava_next import (  # lazy: transformers
        image_size_to_num_patches)

    return [image_size_to_num_patches(size, config.image_grid_pinpoints,
                                      config.vision_config.image_size) for size in sizes]


@dataclass(frozen=True)
class LlavaNextFamily(VisionFamily):
    """Any resolution: each image is a base tile and a grid of tiles (padded to the batch's
    most in ``pixel_values``), unpadded to its aspect with one ``image_newline`` per row."""

    def begin(self, tower, pixels, media, config):
        if pixels.dim() == 5:  # [images, max tiles, C, H, W]: each image's own tiles
            pixels = torch.cat([tiles[:count] for tiles, count in
                                zip(pixels, _tiles(config, media))], dim=0)
        return super().begin(tower, pixels, media, config)

    def project(self, model, hidden, media, config):
        features = model.multi_modal_projector(_selected(hidden, config))
        packed, _ = model.pack_image_features(
            torch.split(features, _tiles(config, media), dim=0), media,
            config.vision_feature_select_strategy, image_newline=model.image_newline)
        return torch.cat(packed, dim=0)

    def image_count(self, inputs):
        return self.media(inputs).shape[0]

    def image_tokens(self, config, media, images):
        """The base tile's features, then the grid's, unpadded, a newline per row."""
        from transformers.models.llava_next.modeling_llava_next import (  # lazy: transformers
            get_anyres_image_grid_shape, unpad_image)

        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        counts = []
        for size in media.tolist():
            rows, cols = get_anyres_image_grid_shape(size, config.image_grid_pinpoints,
                                                     vision.image_size)
            grid = unpad_image(torch.empty((1, rows * side, cols * side), device="meta"), size)
            counts.append(side * side + grid.shape[1] * (grid.shape[2] + 1))
        return torch.tensor(counts, dtype=torch.long)


@dataclass(frozen=True)
class Qwen2VLFamily(VisionFamily):
    """Patches flattened over every image (``[patches, C*T*P*P]``), one attention window and a
    vision rotary table per image from its ``image_grid_thw``, the ``merger`` as projector."""

    def used_blocks(self, config) -> int:
        return config.vision_config.depth

    def begin(self, tower, pixels, media, config):
        return tower.patch_embed(pixels.type(tower.patch_embed.proj.weight.dtype))

    def context(self, tower, hidden, media):
        from transformers.vision_utils import (  # lazy: transformers, seconds to import
            get_vision_attention_seqlens, get_vision_position_ids)

        positions = get_vision_position_ids(media, tower.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(media, tower.config)
        return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
                "position_embeddings": tower.rotary_pos_emb(hidden, positions)}

    def block(self, layer, hidden, context):
        return layer(hidden, **context)

    def project(self, model, hidden, media, config):
        return model.visual.merger(hidden)

    def image_count(self, inputs):
        return self.media(inputs).shape[0]

    def image_tokens(self, config, media, images):
        return media.prod(-1) // config.vision_config.spatial_merge_size ** 2

    def rows(self, media, key):
        return media.prod(-1) if key == "pixel_values" else None


_LLAVA = VisionFamily("llava")
FAMILIES = {
    "llava": _LLAVA,
    "llava_next": LlavaNextFamily(
        "llava_next", projector=("multi_modal_projector", "image_newline"),
        media_keys=("pixel_values", "image_sizes"), inputs=_LLAVA.inputs + ("image_sizes",),
        media_key="image_sizes"),
    "qwen2_vl": Qwen2VLFamily(
        "qwen2_vl", tower="visual", front=("patch_embed",), blocks="blocks", after=(),
        projector=("visual.merger",), media_keys=("pixel_values", "image_grid_thw"),
        inputs=_LLAVA.inputs + ("image_grid_thw", "mm_token_type_ids"),
        media_key="image_grid_thw", media_width=3),
}
"""The families by ``model_type``; the docs (docs/transformers.md) name each one."""


def family_of(config) -> VisionFamily | None:
    """The family of a model's config, or ``None`` (not a VLM this plugin runs in pieces)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and not isinstance(family, Qwen2VLFamily):
        tower = getattr(getattr(config, "vision_config", None), "model_type", None)
        if tower not in SUPPORTED_TOWERS:
            raise ConfigError(f"{family.name} with a {tower!r} vision tower is not supported "
                              f"(towers: {', '.join(SUPPORTED_TOWERS)})")
    return family
