"""Which sample each image belongs to: a vision-language model's answer to the media seam.

A processor lays a batch's images end to end: ``pixel_values`` holds every image (or, for
Qwen2-VL, every patch of every image) of every sample in order, and a sample may hold none, one
or several. Cutting those tensors along dim 0 by position would hand one microbatch another's
images (NeMo AutoModel's #2177: "silently miscorrelates patches with text tokens"). The model
knows better: each image fills a known number of placeholder tokens (:meth:`VisionFamily.
image_tokens`), and each sample's ``input_ids`` hold its placeholders, so image ``j`` belongs to
the sample whose placeholders its tokens fill. :func:`bind_media_seam` gives a model (or a part)
``get_pipeline_kwargs_samples(kwargs)``, which pp-core's microbatch split reads
(:func:`pp_core.runtime.microbatch.kwargs_samples`): every media tensor is then cut by sample,
for the microbatches and for the data-parallel ranks' shares alike.
"""

from __future__ import annotations

import types

import torch

from pp_core import ConfigError

__all__ = ["image_samples", "bind_media_seam", "image_token_id"]


def image_token_id(config) -> int:
    """The placeholder token of a VLM's config (``image_token_id``, once ``image_token_index``)."""
    found = getattr(config, "image_token_id", None)
    return found if found is not None else config.image_token_index


def image_samples(family, config, inputs: dict) -> torch.Tensor:
    """The sample of each image of ``inputs``, in order (``[images]`` int64).

    :raises ConfigError: a sample's placeholders are not filled exactly by whole images (more
        placeholders than images, fewer, or an image cut between two samples).
    """
    input_ids = inputs["input_ids"]
    placeholders = (input_ids == image_token_id(config)).sum(-1).to(torch.long).cpu()
    media = family.media(inputs).cpu()
    tokens = family.image_tokens(config, media, family.image_count(inputs))
    ends = placeholders.cumsum(0)
    firsts = tokens.cumsum(0) - tokens  # each image's first token in the batch's placeholders
    owner = torch.searchsorted(ends, firsts, right=True)
    total = int(ends[-1]) if len(ends) else 0
    if int(tokens.sum()) != total or bool((owner >= len(placeholders)).any()) or \
            bool((firsts + tokens > ends[owner.clamp(max=max(len(ends) - 1, 0))]).any()):
        raise ConfigError(_mismatch(placeholders, tokens))
    return owner


def _mismatch(placeholders: torch.Tensor, tokens: torch.Tensor) -> str:
    """Where a batch's images and placeholders part ways, in words."""
    image, filled = 0, 0
    for sample, wanted in enumerate(placeholders.tolist()):
        got = 0
        while image < len(tokens) and got < wanted:
            got += int(tokens[image])
            image += 1
        if got != wanted:
            return (f"sample {sample} of the batch holds {wanted} image placeholder tokens but "
                    f"its images fill {got} (images of {tokens.tolist()[:8]} tokens each); "
                    f"each image needs the processor's placeholder once in the text, expanded "
                    f"by a processor matching the model")
        filled += got
    return (f"the batch holds {filled} image placeholder tokens but its {len(tokens)} images "
            f"fill {int(tokens.sum())}; give each image the processor's placeholder once in "
            f"the text")


def _samples(self, kwargs: dict) -> dict:
    """``get_pipeline_kwargs_samples``: the sample of each row of every media input."""
    family, config = self.pp_vision_family, self.config
    if not isinstance(kwargs.get("input_ids"), torch.Tensor):
        return {}
    keys = [key for key in family.media_keys if isinstance(kwargs.get(key), torch.Tensor)]
    if not keys:
        return {}
    owner = image_samples(family, config, kwargs)
    media = family.media(kwargs).cpu()
    rows = {key: family.rows(media, key) for key in keys}
    return {key: owner if rows[key] is None else owner.repeat_interleave(rows[key])
            for key in keys}


def _chunk_dims(self, kwargs: dict) -> dict:
    """``get_pipeline_kwargs_chunk_dims``: Qwen2-VL's rotary positions given as inputs,
    ``[3 (or 4), batch, seq]``, are cut on dim 1."""
    ids = kwargs.get("position_ids")
    return {"position_ids": 1} if isinstance(ids, torch.Tensor) and ids.dim() == 3 else {}


def bind_media_seam(model, family) -> None:
    """Give ``model`` (a whole VLM or one of its parts) ``get_pipeline_kwargs_samples`` and
    ``get_pipeline_kwargs_chunk_dims``."""
    model.pp_vision_family = family
    model.get_pipeline_kwargs_samples = types.MethodType(_samples, model)
    model.get_pipeline_kwargs_chunk_dims = types.MethodType(_chunk_dims, model)
