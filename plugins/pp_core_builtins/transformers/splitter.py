"""The ``hf_decoder`` splitter: Hugging Face decoder-only models (and the text half of VLMs).

    split(LlamaForCausalLM with 6 layers, num_stages=3)
    stage 0: model.embed_tokens  model.layers.0  model.layers.1            model.rotary_emb
    stage 1: model.layers.2      model.layers.3                            model.rotary_emb
    stage 2: model.layers.4      model.layers.5   model.norm   lm_head     model.rotary_emb

Layers are spread evenly (counts differ by at most one, extra layers to the interior stages);
``layers_per_stage`` and ``round_virtual_stages_to_pp_multiple`` fix the number of stages through
``num_layers`` (pp-core's :func:`~pp_core.planning.split.virtual_stages`), and
``module_fqns_per_model_part`` replaces the split entirely (this splitter still builds the parts,
so the forwards are patched either way). ``priority`` 400 puts it ahead of pp-core's generic
splitters, including ``fqn``.

A model that is not a ``transformers.PreTrainedModel`` but is laid out like one (NeMo AutoModel's
own classes: a ``model`` / ``language_model`` / ``text_model`` / ``text_decoder`` child holding
``embed_tokens``, ``layers`` and ``norm``, plus ``lm_head``) is split the same way, without
transformers; its parts keep the model's own forwards, which must skip the modules a stage does
not hold (``embed_tokens is None``: the input is the hidden states; ``norm`` / ``lm_head`` is
``None``: pass the hidden states on), as NeMo's own model classes do.
"""

from __future__ import annotations

import sys

from torch import nn

from pp_core import ConfigError
from pp_core_builtins.transformers.forward import BUILTIN_ADAPTERS, DecoderAdapter
from pp_core_builtins.transformers.layout import find_layout, find_text_module, plan_stages
from pp_core_builtins.transformers.parts import build_part, build_plain_part

__all__ = ["HFDecoderSplitter"]


def is_hf_model(model) -> bool:
    transformers = sys.modules.get("transformers")  # never import it just to say no
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _is_hf_shaped(model) -> bool:
    """Laid out like an HF causal LM without being a ``PreTrainedModel`` (NeMo AutoModel's own
    model classes): a text module under a child named as HF names it, holding
    ``embed_tokens``, ``layers`` and ``norm``, and an ``lm_head`` on the root. The layout is
    read from the module tree alone; transformers is not needed."""
    text = find_text_module(model)
    if not text or not isinstance(model._modules.get("lm_head"), nn.Module):
        return False
    return isinstance(model.get_submodule(text)._modules.get("norm"), nn.Module)


class HFDecoderSplitter:
    """Splits HF decoders and builds their stages with stage-friendly forwards.

    :param adapters: ``{model_type: DecoderAdapter}`` for architectures whose forward differs
        from Llama's (added to ``BUILTIN_ADAPTERS``); others use ``default_adapter``. A
        third-party plugin registers a subclass (or an instance with more adapters) under its
        own name with a higher ``priority``.
    """

    name = "hf_decoder"
    priority = 400

    def __init__(self, adapters: dict[str, DecoderAdapter] | None = None,
                 default_adapter: DecoderAdapter | None = None):
        self.adapters = {**BUILTIN_ADAPTERS, **(adapters or {})}
        self.default_adapter = default_adapter or DecoderAdapter()

    # ------------------------------------------------------------------ selection

    def accepts(self, model) -> bool:
        if not is_hf_model(model) and not _is_hf_shaped(model):
            return False
        if find_text_module(model) is None:
            return False
        try:
            layout = find_layout(model)
        except ConfigError:  # e.g. an empty `layers`
            return False
        return layout.text == "" or layout.head is not None  # a bare decoder, or a causal LM

    def rejection(self, model) -> str:
        if not is_hf_model(model) and not _is_hf_shaped(model):
            return ("neither a transformers PreTrainedModel nor laid out like an HF causal LM "
                    "(a `model`, `language_model`, `text_model` or `text_decoder` child with "
                    "`embed_tokens`, `layers` and `norm`, and an `lm_head`)")
        if find_text_module(model) is None:
            return "no text module with `embed_tokens` and a `layers` ModuleList"
        return ("no `lm_head`: only causal LMs (and bare decoders) get stage forwards; a "
                "classification or other head needs its own splitter (docs/transformers.md)")

    def adapter(self, model: nn.Module) -> DecoderAdapter:
        """The adapter for ``model``'s (text) ``model_type``."""
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        for candidate in (text_config, config):
            found = self.adapters.get(getattr(candidate, "model_type", None))
            if found is not None:
                return found
        return self.default_adapter

    # ------------------------------------------------------------------ protocol

    def num_layers(self, model) -> int:
        return len(find_layout(model).layer_keys)

    def units(self, model) -> list[tuple[str, ...]]:
        """Embedding (and whatever goes to the first stage), each decoder layer, norm and head:
        the pieces a cost-balanced split moves; ``rotary_emb`` & co. go to every stage."""
        layout = find_layout(model)
        blocks = [(fqn,) for fqn in layout.layer_fqns()]
        return ([layout.first] if layout.first else []) + blocks + \
            ([layout.last] if layout.last else [])

    def split(self, model, num_stages, config) -> list[list[str]]:
        layout = find_layout(model)
        fixed = getattr(config, "module_fqns_per_model_part", None)
        if fixed is None:
            return plan_stages(layout, num_stages)
        if len(fixed) != num_stages:
            raise ConfigError(
                f"module_fqns_per_model_part has {len(fixed)} parts but the pipeline has "
                f"{num_stages} stages; give exactly {num_stages} lists of module names")
        named = {fqn for part in fixed for fqn in part}
        shared = [fqn for fqn in layout.shared if fqn not in named]
        return [list(part) + [fqn for fqn in shared if fqn not in part] for part in fixed]

    def make_part(self, model, fqns, stage_index, num_stages, config) -> nn.Module:
        if is_hf_model(model):
            part = build_part(model, find_layout(model), fqns, config, self.adapter(model))
        else:  # NeMo-style model class: its own forwards skip the modules a stage lacks
            part = build_plain_part(model, fqns)
        if part.pp_tied_parameters:
            stages = self.split(model, num_stages, config)
            part.pp_tied_stages = {names: _holders(stages, names)
                                   for names in set(part.pp_tied_parameters.values())}
        return part


def _holders(stages: list[list[str]], names: tuple[str, ...]) -> tuple[int, ...]:
    """The stages holding any of ``names`` (a stage holds a name it lists, or a module above it)."""
    def holds(fqns, name):
        return any(name == fqn or name.startswith(fqn + ".") for fqn in fqns)

    return tuple(s for s, fqns in enumerate(stages) if any(holds(fqns, n) for n in names))
