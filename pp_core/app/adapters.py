"""``model.lora`` and ``model.freeze``: the model a run trains, with PEFT adapters and frozen parts.

Applied by :func:`pp_core.app.factories.build_model` (the one recipe of validate, measuring and
every rank), to the whole model before it is split:

* ``model.lora: {r, alpha, dropout, target_modules, ...}`` builds a ``peft.LoraConfig`` (``alpha``
  and ``dropout`` are its ``lora_alpha`` and ``lora_dropout``; every other key is a ``LoraConfig``
  field as PEFT names it: ``layers_to_transform``, ``use_rslora``, ``modules_to_save``, ...) and
  calls ``peft.get_peft_model``, which freezes the base and injects the adapters **in place**.
  The pipeline gets the model PEFT changed, ``peft_model.base_model.model``: the splitter, the
  FQN lists and ``layers_per_stage`` see the model's own module names (``layers.3``), and the
  parameter names are PEFT's inner ones (``layers.3.attn.q_proj.base_layer.weight``,
  ``layers.3.attn.q_proj.lora_A.default.weight``) in the parts, the checkpoints and the optimizer
  state. The PEFT export (:mod:`pp_core.app.export.peft`) maps them back to PEFT's file names.
  ``target_modules`` left out: PEFT's default for a Hugging Face architecture it knows, else
  every ``nn.Linear`` but the output head (the built-in ``gpt``: ``qkv``, ``proj``, ``ffn.0``,
  ``ffn.2``).
* ``model.freeze: [patterns]`` freezes (``requires_grad_(False)``) every parameter whose FQN - as
  above, after LoRA - matches one of the ``fnmatch`` patterns, or lies under a module that does
  (``layers.0`` freezes the whole block, ``"*_embeddings"`` every embedding: YAML wants a
  pattern that starts with ``*`` quoted).

The pipeline then skips what frozen stages need not do (:mod:`pp_core.schedule.frozen`). With
``distributed.tp_size`` > 1 the tensor-parallel plan's entry for an adapted Linear shards its LoRA
layer whole (:mod:`pp_core.parallel.lora_tp`); DoRA is refused here, at once.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from typing import Any, Optional

from pp_core.errors import ConfigError, did_you_mean, install_extra

__all__ = ["apply_adapters", "adapted_meta_model", "lora_config", "freeze_parameters",
           "peft_missing", "peft_model"]

_RENAMED = {"alpha": "lora_alpha", "dropout": "lora_dropout"}


def peft_model(model, config, key: str = "model.lora"):
    """``peft.get_peft_model(model, config)``, without the transformers warning it triggers.

    PEFT's ``PeftModel.__init__`` reads the model's ``is_gradient_checkpointing``, which
    transformers 5 renamed (``is_activation_checkpointing``) and warns about on every read: a
    FutureWarning about PEFT's code, printed by every rank and every LoRA command, that asks
    nothing of the user. Only that one warning is dropped, only here."""
    try:
        from peft import get_peft_model  # lazy: peft is an extra
    except ImportError:
        raise peft_missing(key) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config)


def peft_missing(key: str = "model.lora") -> ConfigError:
    return ConfigError(f"{key} builds adapters with the peft library, which is not installed; "
                       f"install it with {install_extra('lora')} (or pip install peft), or "
                       f"remove {key}")


def lora_config(settings: dict, model=None):
    """The ``peft.LoraConfig`` of ``model.lora`` (``model``: to choose default targets)."""
    try:
        from peft import LoraConfig  # lazy: peft is an extra, needed only with model.lora
    except ImportError:
        raise peft_missing() from None
    import dataclasses  # lazy: with the line above

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in settings.items():
        name = _RENAMED.get(key, key)
        if name not in known or name in ("peft_type", "task_type", "inference_mode"):
            hint = did_you_mean(key, sorted(set(_RENAMED) | known), n=3, before="; ")
            raise ConfigError(f"model.lora.{key} is not a LoRA setting{hint}; the keys are r, "
                              f"alpha, dropout, target_modules and peft.LoraConfig's fields")
        kwargs[name] = value
    alpha = kwargs.get("lora_alpha")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not math.isfinite(alpha) or alpha <= 0):
        raise ConfigError(f"model.lora.alpha: expected a number > 0 (LoRA scales the adapters' "
                          f"output by alpha / r; 0 trains them to no effect), found {alpha!r}")
    if model is not None and not _is_hf(model):
        if kwargs.get("target_modules") is None:
            kwargs["target_modules"] = default_targets(model)
        if kwargs.get("layers_to_transform") is not None and not kwargs.get("layers_pattern"):
            kwargs["layers_pattern"] = _blocks_name(model)  # PEFT's guess needs a prefix
    try:
        return LoraConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.lora: peft.LoraConfig refused it: {exc}") from None


def _is_hf(model) -> bool:
    return hasattr(model, "config") and hasattr(model, "get_output_embeddings")


def _blocks_name(model) -> Optional[str]:
    """The name of the model's numbered container of blocks (``layers`` for ``layers.3``)."""
    for name, _ in model.named_modules():
        parts = name.split(".")
        for index in range(1, len(parts)):
            if parts[index].isdecimal():
                return parts[index - 1]
    return None


def default_targets(model) -> list[str]:
    """Every ``nn.Linear`` of a model PEFT has no default for, but its output head."""
    from torch import nn  # lazy: torch, only with a model in hand

    head = {"output", "lm_head"}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in head:
            # the name inside its block ("layers.3.ffn.0" -> "ffn.0"): PEFT matches suffixes,
            # and layers_to_transform picks the blocks by their index
            parts = name.split(".")
            index = max((i for i in range(len(parts) - 1) if parts[i].isdecimal()), default=-1)
            suffix = ".".join(parts[index + 1:])
            if suffix not in names:
                names.append(suffix)
    if not names:
        raise ConfigError(f"model.lora: {type(model).__name__} has no nn.Linear to adapt; name "
                          f"the modules in model.lora.target_modules")
    return names


def freeze_parameters(model, patterns) -> list[str]:
    """Freeze every parameter matching a pattern (or under a matching module); their names."""
    names = [name for name, _ in model.named_parameters()]
    frozen = []
    for pattern in patterns:
        hit = [n for n in names
               if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, pattern + ".*")]
        if not hit:
            hint = did_you_mean(pattern, sorted({n.rsplit(".", 1)[0] for n in names}), n=3,
                                before="; ")
            raise ConfigError(f"model.freeze: {pattern!r} matches no parameter of "
                              f"{type(model).__name__}{hint}; patterns are fnmatch patterns of "
                              f"parameter or module names (e.g. 'layers.0', 'tok_*'; quote one that starts with *)")
        frozen += hit
    wanted = set(frozen)
    for name, param in model.named_parameters():
        if name in wanted:
            param.requires_grad_(False)
    return sorted(wanted)


def apply_adapters(model, lora: Optional[dict], freeze, tp_size: int = 1):
    """``model`` with ``model.lora``'s adapters (the module PEFT changed in place, unwrapped)
    and ``model.freeze`` applied; ``model`` itself when neither is set."""
    if lora is not None:
        if tp_size > 1 and lora.get("use_dora"):  # the rest: pp_core.parallel.lora_tp's checks
            raise ConfigError(
                f"model.lora.use_dora with distributed.tp_size={tp_size}: DoRA's magnitude "
                f"vectors are not sharded (plain LoRA adapters are, by the tensor-parallel plan); "
                f"set model.lora.use_dora: false, or distributed.tp_size: 1")
        config = lora_config(lora, model)
        try:
            model = peft_model(model, config).base_model.model
            if getattr(model, "pp_checkpoint", None) is not None:  # each stage loads its own
                model.pp_lora_init = config.init_lora_weights  # adapters re-made after loading
        except (ValueError, TypeError, KeyError) as exc:  # e.g. no module matches the targets
            raise ConfigError(f"model.lora: peft could not add the adapters: {exc}; check "
                              f"model.lora.target_modules against the model's module names") from None
    if freeze:
        freeze_parameters(model, freeze)
        if not any(param.requires_grad for param in model.parameters()):
            raise ConfigError(f"model.freeze: {list(freeze)!r} freezes every parameter of "
                              f"{type(model).__name__}: nothing is left to train; freeze fewer "
                              f"modules (e.g. 'tok_embeddings'), or add model.lora")
    return model


def adapted_meta_model(spec, model, problems: list[str]):
    """``pp-core validate``: :func:`apply_adapters` on the meta model (the split then sees the
    frozen stages a rank will see); a refusal goes to ``problems`` and gives ``None``."""
    if spec.model.lora is None and not spec.model.freeze:
        return model
    import torch  # lazy: torch, only with a model in hand

    try:
        with torch.device("meta"):
            return apply_adapters(model, spec.model.lora, spec.model.freeze,
                                  spec.distributed.tp_size)
    except ConfigError as exc:
        problems.append(str(exc))
        return None
