"""Build one stage of a Hugging Face model: prune, untie across stages, patch forwards.

The part is pp-core's pruned shallow copy (:func:`pp_core.planning.parts.prune_model`): kept
modules are the model's own objects, so building a part copies no weights, and its
``state_dict()`` keys are the model's. On top of that:

* **Tied weights.** A weight the model reaches under several names (``model.embed_tokens.weight``
  and ``lm_head.weight`` when ``tie_word_embeddings=True``) that lands on several stages becomes
  one parameter *per stage*: the stage holding the first name keeps the model's tensor, the others
  get a copy under their own name. :mod:`pp_core_builtins.transformers.tied` sums their
  gradients after backward.
  The part records them in ``part.pp_tied_parameters`` (``{local name: every name of the weight}``).
* **Forwards.** The part's text module and root get the stage forwards of
  :mod:`pp_core_builtins.transformers.forward` (``patch_inner_model`` / ``patch_causal_lm_model``).
* **Meta models.** A part of a model built on the meta device gets an ``init_weights()`` that
  pp-core calls once the part has storage: it runs transformers' own per-module init (which also
  refills rotary tables) and then loads this stage's tensors from ``model.pp_checkpoint`` when the
  model names a checkpoint directory (:mod:`pp_core_builtins.transformers.loading`).
"""

from __future__ import annotations

import copy
import types
import zlib

import torch
from torch import nn

from pp_core.planning.parts import prune_model
from pp_core_builtins.transformers.forward import DecoderAdapter, patch_causal_lm, patch_text_module
from pp_core_builtins.transformers.layout import DecoderLayout
from pp_core_builtins.transformers.loading import load_part

__all__ = ["build_part", "build_plain_part", "tie_groups", "init_part_weights"]


def tie_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of each parameter the model reaches under several names, in registration order."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_tensor.values() if len(names) > 1]


def _own_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    return new


def _untie(part: nn.Module, groups: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Give every non-first holder of a tied weight its own parameter; return what is tied."""
    held_names = dict(part.named_parameters(remove_duplicate=False))
    tied: dict[str, tuple[str, ...]] = {}
    for names in groups:
        mine = [name for name in names if name in held_names]
        if not mine or len(mine) == len(names):
            continue  # not here, or every name on this stage: the weight stays shared
        for name in mine:
            tied[name] = names
        if names[0] in mine:
            continue  # this stage keeps the model's own tensor
        source = held_names[mine[0]]
        clone = nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)
        for name in mine:
            owner_name, _, attr = name.rpartition(".")
            owner = _replace_on_path(part, owner_name)
            owner._parameters[attr] = clone
    return tied


def _replace_on_path(part: nn.Module, fqn: str) -> nn.Module:
    """Make the module at ``fqn`` (and its ancestors) this part's own copy, then return it."""
    module = part
    for piece in fqn.split(".") if fqn else []:
        child = _own_copy(module._modules[piece])
        module._modules[piece] = child
        module = child
    return module


def _walk_init(module: nn.Module, init, seen: set[int]) -> None:
    from transformers import PreTrainedModel  # lazy: transformers, seconds to import

    for child in module.children():
        _walk_init(child, child._init_weights if isinstance(child, PreTrainedModel) else init, seen)
    if id(module) not in seen:
        seen.add(id(module))
        try:
            init(module)
        except (AttributeError, TypeError):
            # its init reaches a parameter another stage holds (LLaVA-NeXT's image_newline is
            # None here); what this part holds of it is initialised by its children's inits
            if all(p is not None for p in module._parameters.values()):
                raise


def _refill_rotary(part: nn.Module) -> None:
    """Recompute rotary tables (non-persistent, so never in a checkpoint) from their config.

    transformers 5 refills them in ``_init_weights``; transformers 4 computes them only in the
    constructor, so a fresh module is built on the part's device and its buffers copied.
    """
    for module in {id(m): m for m in part.modules()}.values():
        if not type(module).__name__.endswith("RotaryEmbedding") or \
                getattr(module, "config", None) is None or not hasattr(module, "inv_freq"):
            continue
        with torch.device(module.inv_freq.device):
            fresh = type(module)(config=module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buffer)
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling


def init_part_weights(part: nn.Module) -> None:
    """Initialise a freshly materialised part with transformers' per-module init, then load.

    Runs each module's ``_init_weights`` (the owning ``PreTrainedModel``'s) and refills rotary
    tables; never re-ties weights. Then, when the model named a checkpoint directory
    (``pp_checkpoint``), loads this part's tensors from it.
    """
    with torch.no_grad():
        _walk_init(part, part._init_weights, set())
        _refill_rotary(part)
    checkpoint = getattr(part, "pp_checkpoint", None)
    if checkpoint is not None:
        load_part(part, checkpoint)
    _reset_adapters(part)


def _reset_adapters(part: nn.Module) -> None:
    """PEFT LoRA layers (``model.lora`` on a model loaded per stage): the per-module init above
    overwrote their adapters; give them PEFT's init again, seeded by name, so every rank and
    replica agrees and ``lora_B`` starts at zero (the adapted model starts as the base)."""
    for name, module in part.named_modules():
        reset = getattr(module, "reset_lora_parameters", None)
        if reset is None:
            continue
        for adapter in list(getattr(module, "lora_A", {}).keys()):
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(zlib.crc32(f"{name}.{adapter}".encode()))
                reset(adapter, getattr(part, "pp_lora_init", True))


def build_part(model: nn.Module, layout: DecoderLayout, fqns, config,
               adapter: DecoderAdapter) -> nn.Module:
    """One stage of ``model`` holding ``fqns``, untied and with stage forwards (see module doc)."""
    part = prune_model(model, list(fqns))
    part.pp_tied_parameters = _untie(part, tie_groups(model))
    text = part.get_submodule(layout.text) if layout.text else part
    if config is None or config.patch_inner_model:
        if layout.text:
            text = _replace_on_path(part, layout.text)
        patch_text_module(text, adapter)
    if layout.text and (config is None or config.patch_causal_lm_model):
        patch_causal_lm(part, layout.text, layout.head, adapter)
    if any(t.is_meta for t in model.parameters()):
        part.init_weights = types.MethodType(init_part_weights, part)
    return part


def build_plain_part(model: nn.Module, fqns) -> nn.Module:
    """One stage of a model laid out like an HF decoder but not a ``PreTrainedModel``: pruned
    and untied as :func:`build_part` does, its forwards left as the model wrote them."""
    part = prune_model(model, list(fqns))
    part.pp_tied_parameters = _untie(part, tie_groups(model))
    return part
