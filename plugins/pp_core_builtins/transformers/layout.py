"""Where the pieces of a Hugging Face decoder live, and which stage each piece goes to.

A decoder-only HF model nests a *text module* (``LlamaModel`` & co.) that holds
``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``; the causal-LM wrapper adds ``lm_head``::

    LlamaForCausalLM                       LlavaForConditionalGeneration (VLM, transformers 5)
      model            <- text module        model
        embed_tokens   -> first stage          vision_tower           -> first stage
        layers.0..L-1  -> spread                multi_modal_projector -> first stage
        norm           -> last stage            language_model        <- text module
        rotary_emb     -> every stage         lm_head                 -> last stage
      lm_head          -> last stage

The rule is the ``layers`` contract (docs/splitting.md) applied at every level: a child registered
before the branch that leads to the layers goes to the first stage, one registered after it to
the last stage, and a child without parameters (a rotary table) goes to every stage. Nothing
here imports ``transformers``: the layout is read from the module tree alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pp_core import ConfigError
from pp_core.planning.partition import spread_between

__all__ = ["DecoderLayout", "find_layout", "find_text_module", "plan_stages"]

TEXT_MODULE_NAMES = ("model", "language_model", "text_model", "text_decoder", "decoder",
                     "transformer")
"""Children searched, in this order, for the text module when the root is not one itself."""


def _is_text_module(module: nn.Module) -> bool:
    layers = module._modules.get("layers")
    return isinstance(layers, (nn.ModuleList, nn.ModuleDict)) and "embed_tokens" in module._modules


def find_text_module(model: nn.Module, max_depth: int = 3) -> str | None:
    """The dotted name of the module holding ``embed_tokens`` and ``layers`` ('' = the root)."""
    if _is_text_module(model):
        return ""
    if max_depth == 0:
        return None
    for name in TEXT_MODULE_NAMES:
        child = model._modules.get(name)
        if isinstance(child, nn.Module):
            found = find_text_module(child, max_depth - 1)
            if found is not None:
                return f"{name}.{found}" if found else name
    return None


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class DecoderLayout:
    """The module names of one HF decoder, grouped by the stage(s) that hold them.

    ``text`` is the text module's name (``"model"``, ``"model.language_model"``, ``""`` for a
    bare ``LlamaModel``); ``layer_keys`` are the keys of its ``layers`` container in order;
    ``first`` / ``last`` go to the first / last stage, ``shared`` to every stage; ``head`` is the
    output projection (``"lm_head"``) or ``None`` when the root has none.
    """

    text: str
    layer_keys: tuple[str, ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    shared: tuple[str, ...]
    head: str | None

    @property
    def layers(self) -> str:
        return _join(self.text, "layers")

    def layer_fqns(self) -> list[str]:
        return [f"{self.layers}.{key}" for key in self.layer_keys]


def find_layout(model: nn.Module) -> DecoderLayout:
    """Read the :class:`DecoderLayout` of ``model``; ConfigError if it has no text module."""
    text = find_text_module(model)
    if text is None:
        raise ConfigError(
            f"{type(model).__name__} has no text module with `embed_tokens` and a `layers` "
            f"ModuleList (looked in the root and in {', '.join(TEXT_MODULE_NAMES)}); split it "
            f"with module_fqns_per_model_part or add a splitter for it (docs/transformers.md)")
    first: list[str] = []
    last_by_depth: list[list[str]] = []
    shared: list[str] = []
    path = text.split(".") if text else []
    # Walk from the root down to the text module, sorting each level's other children.
    module, prefix = model, ""
    for depth in range(len(path) + 1):
        branch = path[depth] if depth < len(path) else "layers"
        seen, last = False, []
        last_by_depth.append(last)
        for name, child in module._modules.items():
            if name == branch:
                seen = True
                continue
            if child is None:
                continue
            fqn = _join(prefix, name)
            if not _has_params(child):
                shared.append(fqn)
            else:
                (last if seen else first).append(fqn)
        for name, param in module._parameters.items():
            if param is not None:
                first.append(_join(prefix, name))
        if depth < len(path):
            module, prefix = module._modules[branch], _join(prefix, branch)
    last = [fqn for level in reversed(last_by_depth) for fqn in level]  # norm before lm_head
    layers = module._modules["layers"]
    keys = tuple(key for key, block in layers._modules.items() if block is not None)
    if not keys:
        raise ConfigError(f"{type(model).__name__}.{_join(text, 'layers')} is empty; there is "
                          f"nothing to split")
    head = "lm_head" if isinstance(model._modules.get("lm_head"), nn.Module) else None
    if head is None:
        head = next((f for f in last if f.rsplit(".", 1)[-1] == "lm_head"), None)
    return DecoderLayout(text, keys, tuple(first), tuple(last), tuple(shared), head)


def plan_stages(layout: DecoderLayout, num_stages: int) -> list[list[str]]:
    """Module names per stage: first-stage modules, the layers spread evenly, last-stage modules.

    Layer counts differ by at most one, extra layers going to the interior stages first (the
    first and last stages carry the embedding and the head); parameter-free modules such as
    ``rotary_emb`` are on every stage.
    """
    keys = layout.layer_fqns()
    if len(keys) < num_stages:
        raise ConfigError(
            f"the model has {len(keys)} decoder layers, cannot give {num_stages} stages at least "
            f"one each; use at most {len(keys)} stages (fewer ranks or stages per rank)")
    return [fqns + list(layout.shared)
            for fqns in spread_between(layout.first, keys, layout.last, num_stages)]
