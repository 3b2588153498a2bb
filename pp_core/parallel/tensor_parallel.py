"""Torch's tensor parallelism inside a pipeline stage: ``parallelize_module`` on each model part.

``apply_tensor_parallel(model_parts, tp_mesh, plan=None, sequence_parallel=False)`` shards every
part in place over the 1-D ``tp_mesh`` (the ``"tp"`` dimension of the ``("pp", "dp_replicate",
"dp_shard", "tp")`` mesh) with torch's own styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``, ...). Parameter names never change: a sharded
parameter becomes a DTensor under the same FQN, so checkpoints, tied weights and the optimizer
see the same names. Apply it right after the split and before activation checkpointing, compile
and FSDP2 (torchtitan's order: TP, AC, compile, then FSDP2 on the ``dp_shard`` sub-mesh).

A *plan* is a ``parallelize_module`` plan: ``{module path: ParallelStyle}``, paths relative to
the model (``layers.*.qkv``; ``*`` matches one name: the one matcher of TP and EP plans,
:mod:`pp_core.parallel.plans`). Entries whose module a part does not hold (the embedding on a
later stage) are skipped, so one plan serves every part. Plans come from plugins, through the
plugin facade: the hook ``pp_tensor_parallel_plan(model, sequence_parallel)`` (docs/plugins.md);
the built-in plugins answer for the demo GPT and the supported Hugging Face decoders. The rule
for parts is EP's: a part no plugin has a plan for is left alone, no plan for any part is
refused. A plan entry that names a Linear PEFT has wrapped (``model.lora``) shards the LoRA layer
whole: base and adapters, one input and output preparation (:mod:`pp_core.parallel.lora_tp`).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pp_core.errors import ConfigError
from pp_core.parallel.lora_tp import adapter_problems, base_module, lora_style, style_side
from pp_core.parallel.plans import matching_modules, plans_of_parts

__all__ = ["apply_tensor_parallel", "tensor_parallel_plan", "check_tensor_parallel",
           "plan_modules", "reduce_partial_gradients", "head_counts", "NO_PLAN_HELP"]

NO_PLAN_HELP = (
    "a tensor-parallel plan is a parallelize_module plan ({module path: ParallelStyle}); provide "
    "one with a plugin implementing the hook pp_tensor_parallel_plan(model, sequence_parallel) "
    "(docs/plugins.md), pass plan= to pp_core.parallel.apply_tensor_parallel, or set "
    "distributed.tp_size: 1")


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False,
                         plugins=None) -> dict[str, Any]:
    """The plan the installed plugins give for ``model`` (a whole model or one part).

    :raises ConfigError: no plugin knows the model (the message says how to provide a plan).
    """
    from pp_core.plugin_manager import plugins_or_default  # lazy: loads the entry points

    plan = plugins_or_default(plugins).tensor_parallel_plan(model, sequence_parallel)
    if plan is None:
        raise ConfigError(f"distributed.tp_size: no plugin provides a tensor-parallel plan for "
                          f"the model {type(model).__name__}; {NO_PLAN_HELP}")
    return dict(plan)


plan_modules = matching_modules
"""``[(fqn, module, style)]`` for every module of ``model`` a plan entry matches
(:func:`pp_core.parallel.plans.matching_modules`)."""


def apply_tensor_parallel(model_parts: list[nn.Module], tp_mesh, plan: Optional[dict] = None,
                          sequence_parallel: bool = False, plugins=None) -> int:
    """Shard each part in place over ``tp_mesh``; returns how many modules were parallelized.

    :param model_parts: this rank's parts (``pipe.model_parts``), after the split.
    :param tp_mesh: a 1-D ``DeviceMesh`` (``mesh["tp"]``); of size 1 nothing happens.
    :param plan: a ``parallelize_module`` plan for every part; ``None``: each part's plan from
        the ``pp_tensor_parallel_plan`` hook (a part it passes on is left alone; no plan for any
        part is a :class:`ConfigError` saying how to provide one).
    :param sequence_parallel: passed to the hook (a given ``plan`` already chose).
    """
    from torch.distributed.tensor.parallel import parallelize_module  # lazy: torch.distributed

    if tp_mesh is None or tp_mesh.size() == 1:
        return 0
    if tp_mesh.ndim != 1:
        raise ConfigError(f"apply_tensor_parallel: expected a 1-D tp mesh (mesh['tp']), found "
                          f"{tp_mesh.ndim} dimensions")
    from pp_core.plugin_manager import plugins_or_default  # lazy: loads the entry points

    facade = plugins_or_default(plugins) if plan is None else None
    planned = plans_of_parts(model_parts, plan,
                             lambda part: facade.tensor_parallel_plan(part, sequence_parallel))
    if not planned:
        names = sorted({type(p).__name__ for p in model_parts})
        raise ConfigError(f"distributed.tp_size: no plugin provides a tensor-parallel plan for "
                          f"the model {', '.join(names)}; {NO_PLAN_HELP}")
    count = 0
    for part, part_plan in planned:
        problems = check_tensor_parallel(part, part_plan, tp_mesh.size())
        if problems:
            raise ConfigError("; ".join(problems))
        for name, module, style in plan_modules(part, part_plan):
            frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
            parallelize_module(module, tp_mesh, lora_style(module, style))  # PEFT's: whole
            _refreeze(module, frozen)
            count += 1
    return count


def _refreeze(module: nn.Module, frozen: list[str]) -> None:
    """Freeze again what was frozen (``model.freeze``, LoRA's base): torch's
    ``SequenceParallel`` (2.13 to 2.15) makes new parameters that all require a gradient."""
    params = dict(module.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)


_HEAD_NAMES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads",
               "num_kv_heads", "n_kv_heads")


def head_counts(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Every head count of the model (``num_heads``, ``num_key_value_heads``, ... on its modules
    or their ``config``), by attribute: ``(value, the first module holding it)``; tp must
    divide each."""
    heads: dict[str, tuple[int, str]] = {}
    for name, module in model.named_modules():
        for source in (module, getattr(module, "config", None)):
            for attr in _HEAD_NAMES:
                value = getattr(source, attr, None) if source is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    heads.setdefault(attr, (value, name or type(model).__name__))
    return heads


def check_tensor_parallel(model: nn.Module, plan: dict, tp_size: int,
                          key: str = "distributed.tp_size") -> list[str]:
    """What keeps ``plan`` from sharding ``model`` ``tp_size`` ways: each sharded dimension
    (out features of a column-wise Linear, in features of a row-wise one, rows of a row-wise
    Embedding) and every head count of the model (``num_heads``, ``num_key_value_heads``, ... on
    its modules or its ``config``) must be divisible by ``tp_size``, and its PEFT layers
    shardable (:func:`~pp_core.parallel.lora_tp.adapter_problems`). Problems name the key, the
    module and the fix; none when the plan fits."""
    problems = []
    if tp_size <= 1:
        return problems
    fix = f"use a {key} that divides it, or change the model"
    for name, module, style in plan_modules(model, plan):
        side, module = style_side(style), base_module(module)  # a LoRA layer: its Linear's
        if side is None:
            continue
        if isinstance(module, nn.Linear):
            size, what = ((module.out_features, "out_features") if side == "out"
                          else (module.in_features, "in_features"))
        elif isinstance(module, nn.Embedding):
            size, what = ((module.embedding_dim, "embedding_dim") if side == "out"
                          else (module.num_embeddings, "num_embeddings (vocabulary)"))
        else:
            continue
        if size % tp_size:
            problems.append(f"{key}: {tp_size} does not divide {name}.{what} = {size}; {fix}")
    for attr, (value, where) in head_counts(model).items():
        if value % tp_size:
            problems.append(f"{key}: {tp_size} does not divide {attr} = {value} (of {where}); "
                            f"each tp rank computes whole heads; {fix}")
    return problems + adapter_problems(model, plan, key)


def reduce_partial_gradients(params) -> int:
    """Give every DTensor gradient the placements of its parameter; returns how many changed.

    A parameter replicated over tp that sees sequence shards (a norm under sequence parallelism)
    gets a gradient that is a partial sum on each tp rank. ``Pipeline.step`` reduces it once per
    step, after the last microbatch (one all-reduce per such parameter per step, not one per
    microbatch), so optimizers, clipping and checkpoints see the parameter's own layout. A
    gradient torch left replicated (a row-wise embedding's) is sliced to its shard, no traffic.
    """
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed

    count = 0
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and \
                tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
            count += 1
    return count
