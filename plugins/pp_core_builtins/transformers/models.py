"""The ``hf_causal_lm`` and ``hf_image_text_to_text`` models a YAML pipeline can name, and the
loss that goes with them.

    model:
      name: hf_causal_lm            # or hf_image_text_to_text (a vision-language model)
      args:
        config: {model_type: llama, hidden_size: 64, num_hidden_layers: 4, ...}   # or a local path
        checkpoint: /path/to/saved/model     # optional: weights loaded per stage
    pipeline:
      loss_fn: pp_core_builtins.transformers:causal_lm_loss

No network access is ever attempted: a path must be a local directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from pp_core import ConfigError
from pp_core.config import resolve_dtype
from pp_core_builtins.transformers.loading import has_checkpoint, load_part
from pp_core_builtins.transformers.media import bind_media_seam
from pp_core_builtins.transformers.vision import FAMILIES, family_of

__all__ = ["hf_causal_lm", "hf_image_text_to_text", "causal_lm_loss", "hf_config"]


def hf_config(config: Any, **overrides):
    """A transformers ``PretrainedConfig`` from a dict (with ``model_type``) or a local path."""
    from transformers import AutoConfig, PretrainedConfig  # lazy: transformers, seconds to import

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.exists():
            raise ConfigError(
                f"model.args.config={str(config)!r} is not a local file or directory; pp-core "
                f"never downloads models: save it with save_pretrained() and give that directory")
        return AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
    if isinstance(config, dict):
        values = {**config, **overrides}
        model_type = values.pop("model_type", None)
        if not model_type:
            raise ConfigError(
                "model.args.config needs a model_type (e.g. 'llama', 'qwen2', 'mistral') so the "
                "right transformers config class is used")
        try:
            return AutoConfig.for_model(model_type, **values)
        except ValueError as exc:
            raise ConfigError(f"model.args.config.model_type={model_type!r}: {exc}") from None
    raise ConfigError(f"model.args.config={config!r} must be a dict with model_type, or a local "
                      f"directory holding config.json")


def hf_causal_lm(
    config: Any,
    checkpoint: Optional[str] = None,
    meta: Optional[bool] = None,
    seed: int = 0,
    dtype: Optional[str] = None,
    attn_implementation: Optional[str] = None,
):
    """A transformers ``AutoModelForCausalLM`` built from ``config``.

    :param config: a dict with ``model_type`` and config fields, or a local directory
        (``save_pretrained`` output); a directory holding safetensors weights is also the
        default ``checkpoint``.
    :param checkpoint: a local directory of safetensors weights; each stage loads only its own.
    :param meta: build on the meta device (no memory); each stage is materialised and filled on
        its rank. Defaults to ``True`` with a checkpoint, else ``False``.
    :param seed: seed of the random init without a checkpoint (every rank builds the same model).
    :param dtype: parameter dtype, e.g. ``"bfloat16"`` (default: the config's, else float32).
    :param attn_implementation: ``"sdpa"``, ``"eager"``, ... (default: transformers' choice).
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers, seconds to import

    return _build(AutoModelForCausalLM, "hf_causal_lm", config, checkpoint, meta, seed, dtype,
                  attn_implementation)


def hf_image_text_to_text(
    config: Any,
    checkpoint: Optional[str] = None,
    meta: Optional[bool] = None,
    seed: int = 0,
    dtype: Optional[str] = None,
    attn_implementation: Optional[str] = None,
):
    """A transformers ``AutoModelForImageTextToText`` (a vision-language model: LLaVA,
    LLaVA-NeXT, Qwen2-VL) built from ``config``; the arguments are :func:`hf_causal_lm`'s.
    The model answers the media seam (:mod:`.media`), so its images follow their samples."""
    from transformers import AutoModelForImageTextToText  # lazy: transformers, seconds

    model = _build(AutoModelForImageTextToText, "hf_image_text_to_text", config, checkpoint,
                   meta, seed, dtype, attn_implementation)
    bind_media_seam(model, family_of(model.config))
    return model


def _check_kind(auto_class, name: str, hf) -> None:
    """Refuse a config the model name cannot build, naming the one that can."""
    model_type = getattr(hf, "model_type", None)
    vision = model_type in FAMILIES
    if name == "hf_causal_lm" and vision:
        raise ConfigError(f"model.args.config: model_type {model_type!r} is a vision-language "
                          f"model; use model.name: hf_image_text_to_text")
    if name == "hf_image_text_to_text" and not vision:
        known = type(hf) in auto_class._model_mapping
        what = (f"is an image-text-to-text model pp-core does not run in pieces yet (supported: "
                f"{', '.join(FAMILIES)})") if known else \
            "is not an image-text-to-text model; use model.name: hf_causal_lm"
        raise ConfigError(f"model.args.config: model_type {model_type!r} {what}")


def _build(auto_class, name, config, checkpoint, meta, seed, dtype, attn_implementation):
    if checkpoint is None and isinstance(config, (str, os.PathLike)) and has_checkpoint(config):
        checkpoint = str(config)
    if checkpoint is not None and not has_checkpoint(checkpoint):
        raise ConfigError(f"model.args.checkpoint={str(checkpoint)!r} is not a directory holding "
                          f"safetensors weights (model.safetensors or an index of shards)")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    hf = hf_config(config, **extra)
    _check_kind(auto_class, name, hf)
    torch_dtype = resolve_dtype(dtype) if dtype is not None else torch.float32
    meta = checkpoint is not None if meta is None else bool(meta)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        if meta:
            with torch.device("meta"):
                model = auto_class.from_config(hf)
        else:
            model = auto_class.from_config(hf)
    finally:
        torch.set_default_dtype(previous)
    model.pp_checkpoint = str(checkpoint) if checkpoint is not None else None
    if checkpoint is not None and not meta:
        load_part(model, checkpoint)
    return model


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *,
                   num_valid_tokens=None) -> torch.Tensor:
    """Next-token cross entropy as transformers computes it: shift by one, ignore ``-100``.

    ``logits`` [batch, seq, vocab], ``labels`` [batch, seq] (usually the input ids with padding
    set to ``-100``); the mean over the counted tokens of this microbatch, or, with
    ``num_valid_tokens`` (the pipeline's count of the whole step, as transformers'
    ``num_items_in_batch``), their sum divided by it.
    """
    vocab = logits.shape[-1]
    shifted = logits[..., :-1, :].reshape(-1, vocab).float()
    if num_valid_tokens is None:
        return torch.nn.functional.cross_entropy(shifted, labels[..., 1:].reshape(-1),
                                                 ignore_index=-100)
    total = torch.nn.functional.cross_entropy(shifted, labels[..., 1:].reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return total / num_valid_tokens


def count_shifted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The targets :func:`causal_lm_loss` counts: ``labels[..., 1:] != -100``."""
    return (labels[..., 1:] != -100).sum()


causal_lm_loss.count_valid_tokens = count_shifted_tokens
causal_lm_loss.shifts_labels = True  # labels are the input ids (validate: check_labels)
