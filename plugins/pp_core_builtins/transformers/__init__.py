"""Hugging Face ``transformers`` models for pp-core: split, patch, tie, load, name in YAML.

Provides the ``hf_decoder`` splitter (decoder-only models: stage-friendly forwards, tied
embeddings across stages), the ``hf_vision_language`` splitter (LLaVA, LLaVA-NeXT, Qwen2-VL:
the vision tower's blocks and the projector as units of the split, images cut by sample), the
``hf_causal_lm`` and ``hf_image_text_to_text`` models and the ``image_text`` dataset a YAML
pipeline can name. Needs ``pip install "pp-core-torch[transformers]"``; without it this plugin
still loads (nothing here imports ``transformers`` at import time), its splitter accepts no
model, and ``hf_causal_lm`` says what to install. See ``docs/transformers.md``.

Nor does it import torch: ``pp-core schedule`` loads every plugin and must stay fast. The hooks
import this package's modules when they are called, and the names below load on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from pp_core import PluginError, hookimpl
from pp_core.callables import LazyCallable
from pp_core.lazy import lazy_face
from pp_core.errors import install_extra

__all__ = [
    "HFDecoderSplitter",
    "DecoderAdapter",
    "DecoderLayout",
    "find_layout",
    "hf_causal_lm",
    "hf_image_text_to_text",
    "causal_lm_loss",
    "load_part",
    "checkpoint_index",
    "sync_tied_gradients",
    "sync_tied_gradients_of",
    "INSTALL",
    "PP_CORE_UNAVAILABLE",
]

INSTALL = install_extra("transformers")

_HOMES = {"HFDecoderSplitter": "splitter", "DecoderAdapter": "forward", "DecoderLayout": "layout",
          "find_layout": "layout", "load_part": "loading", "checkpoint_index": "loading",
          "sync_tied_gradients": "tied", "sync_tied_gradients_of": "tied"}

__getattr__, __dir__ = lazy_face(__name__, {name: f".{home}" for name, home in _HOMES.items()})


def _missing() -> list[str]:
    missing = []
    for name in ("transformers", "safetensors"):
        try:
            found = sys.modules[name] is not None if name in sys.modules else \
                importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


_MISSING = _missing()
PP_CORE_UNAVAILABLE = (f"{' and '.join(_MISSING)} {'is' if len(_MISSING) == 1 else 'are'} not "
                       f"installed; {INSTALL}") if _MISSING else None
"""Why this plugin cannot work here (``pp-core plugins`` shows it), or ``None``."""


def _require_transformers(factory: str) -> None:
    """Refuse ``factory`` by name when transformers is missing, saying how to install it."""
    if _missing():
        raise PluginError(f"model {factory!r} needs Hugging Face transformers: "
                          f"{PP_CORE_UNAVAILABLE or INSTALL}")


def hf_causal_lm(config, **kwargs):
    """The ``hf_causal_lm`` model factory (see
    :func:`pp_core_builtins.transformers.models.hf_causal_lm`)."""
    _require_transformers("hf_causal_lm")
    from pp_core_builtins.transformers.models import hf_causal_lm as build  # lazy: torch

    return build(config, **kwargs)


def hf_image_text_to_text(config, **kwargs):
    """The ``hf_image_text_to_text`` model factory (see
    :func:`pp_core_builtins.transformers.models.hf_image_text_to_text`)."""
    _require_transformers("hf_image_text_to_text")
    from pp_core_builtins.transformers.models import hf_image_text_to_text as build  # lazy: torch

    return build(config, **kwargs)


hf_causal_lm.pp_path_args = ("config", "checkpoint")  # relative to the pipeline file
hf_image_text_to_text.pp_path_args = ("config", "checkpoint")


def causal_lm_loss(logits, labels, *, num_valid_tokens=None):
    """Shifted next-token cross entropy ignoring ``-100``
    (``pp_core_builtins.transformers:causal_lm_loss``); token-normalised over the step in a
    pipeline (``num_valid_tokens``, docs/data.md)."""
    from pp_core_builtins.transformers.models import causal_lm_loss as loss  # lazy: torch

    return loss(logits, labels, num_valid_tokens=num_valid_tokens)


def _count_shifted_tokens(labels):
    from pp_core_builtins.transformers.models import count_shifted_tokens  # lazy: torch

    return count_shifted_tokens(labels)


causal_lm_loss.count_valid_tokens = _count_shifted_tokens
causal_lm_loss.shifts_labels = True  # labels are the input ids (validate: check_labels)


class _LazySplitter:
    """A splitter as registered (``hf_decoder``, ``hf_vision_language``): made on first use of
    any of its attributes (``accepts``, ``split``, ``priority``, ...), so that registering it -
    which ``pp-core plugins`` does - imports neither torch nor transformers."""

    def __init__(self, name: str, module: str, cls: str):
        self.__dict__.update(name=name, where=(module, cls))

    def __getattr__(self, attr):
        if attr.startswith("__"):  # copy, pickle and friends probe for these: none here
            raise AttributeError(attr)
        splitter = self.__dict__.get("splitter")
        if splitter is None:
            module, cls = self.__dict__["where"]
            made = getattr(importlib.import_module(module), cls)()  # lazy: torch
            splitter = self.__dict__["splitter"] = made
        return getattr(splitter, attr)

    def __repr__(self) -> str:
        return f"<{self.__dict__['name']} splitter, made on first use>" \
            if "splitter" not in self.__dict__ else repr(self.__dict__["splitter"])


@hookimpl
def pp_register_splitters(register):
    register("hf_decoder", _LazySplitter("hf_decoder", "pp_core_builtins.transformers.splitter",
                                         "HFDecoderSplitter"))
    register("hf_vision_language", _LazySplitter(
        "hf_vision_language", "pp_core_builtins.transformers.vision_splitter",
        "HFVisionLanguageSplitter"))


@hookimpl
def pp_register_models(register):
    register("hf_causal_lm", hf_causal_lm)
    register("hf_image_text_to_text", hf_image_text_to_text)


@hookimpl
def pp_register_datasets(register):
    register("image_text", LazyCallable("pp_core_builtins.transformers.image_text:image_text"))


@hookimpl
def pp_expert_parallel_plan(model):
    """The plan of a Hugging Face MoE decoder: its stacked-weight experts modules
    (:mod:`pp_core_builtins.transformers.experts`)."""
    if _missing() or not hasattr(model, "config") or "transformers" not in \
            type(model).__module__:
        return None
    from pp_core_builtins.transformers.experts import expert_parallel_plan  # lazy: torch

    return expert_parallel_plan(model)


@hookimpl
def pp_tensor_parallel_plan(model, sequence_parallel):
    """Llama / Qwen2 / Mistral (``tp_plan.SUPPORTED``) and the VLMs built on them; ``None``
    for any other model."""
    if getattr(getattr(model, "config", None), "model_type", None) not in (
            "llama", "qwen2", "mistral", "llava", "llava_next", "qwen2_vl"):
        return None
    from pp_core_builtins.transformers.tp_plan import hf_decoder_plan  # lazy: torch

    return hf_decoder_plan(model, sequence_parallel)
