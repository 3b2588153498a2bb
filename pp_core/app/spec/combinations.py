"""The spec's checks that read more than one key, and the sections that build a library value.

Each key is checked alone by its schema entry (:mod:`pp_core.app.spec.schema`); what no single key
can judge - both or neither, implied keys, the parallel degrees against the world
(:class:`~pp_core.parallel.dims.ParallelDims`), the pipeline section as a :class:`PipelineConfig`,
the optimizer's arguments against its torch class - is judged here, every problem collected.
"""

from __future__ import annotations

import inspect
import os

from pp_core.app.elastic import refit, replica_formula, replica_ranks
from pp_core.app.spec.checkers import describe_value, node_range
from pp_core.config import PipelineConfig, is_auto
from pp_core.errors import ConfigError, closest, did_you_mean
from pp_core.parallel.dims import ParallelDims
from pp_core.schedule.limits import MAX_MICROBATCHES

__all__ = ["check_combinations", "auto_expert_parallel_refusal"]


def check_combinations(values: dict, problems: list[str],
                       checkpoints_off: bool = False) -> PipelineConfig | None:
    """Combinations no single key can judge: both/neither, implied keys, divisibility; returns
    the spec's :class:`PipelineConfig` (``None`` when the pipeline section is wrong).

    ``checkpoints_off``: ``checkpoint.dir: null`` was written out (``--set checkpoint.dir=null``
    turns a file's checkpoints off), so ``checkpoint.every`` is moot; an ``every`` with no ``dir``
    at all is a forgotten ``dir``.
    """
    model, dist = values["model"], values["distributed"]
    if (model["name"] is None) == (model["target"] is None):
        found = "both" if model["name"] else "neither"
        problems.append(f"model: expected exactly one of model.name (a registered model) or "
                        f"model.target ('module:callable'), found {found}")
    ckpt = values["checkpoint"]
    if ckpt["dir"] is None:
        for name, value in (("every", ckpt["every"] and not checkpoints_off),
                            ("resume", ckpt["resume"] is True)):
            if value:
                problems.append(f"checkpoint.{name}: needs checkpoint.dir, found "
                                f"checkpoint.dir unset; add checkpoint.dir: <path>")
    export = ckpt.get("export_hf")
    if export and ckpt["dir"] and os.path.abspath(export["dir"]) == os.path.abspath(ckpt["dir"]):
        problems.append(f"checkpoint.export_hf: {export['dir']!r} is checkpoint.dir too (both "
                        f"write step_NNNNNNNN there); export into another directory, e.g. "
                        f"{os.path.join(export['dir'], 'hf')!r}")
    problems.extend(_dtype_problems(model))
    _fold_dp_size(dist, problems)
    problems.extend(_restart_problems(dist, ckpt, values["pipeline"]))
    dims = ParallelDims.of(dist)
    nodes = node_range(dist["nnodes"])[1]  # the degrees are the whole run's, at MAX nodes
    problems.extend(dims.problems(nodes, dist["nproc_per_node"]))
    problems.extend(_layout_problems(dist, dims))
    if dims.ep > 1 and is_auto(values["pipeline"].get("pp_schedule")):
        problems.append(auto_expert_parallel_refusal(dims.ep))
    if nodes > 1 and dist["master_port"] is None and dist["rdzv_endpoint"] is None:
        problems.append("distributed.master_port: expected a port every node can reach when "
                        "nnodes > 1 (or set distributed.rdzv_endpoint: host:port), found none")
    if dist["node_rank"] is not None and dist["node_rank"] >= nodes:
        problems.append(f"distributed.node_rank: expected this machine's index 0.."
                        f"{nodes - 1} (nnodes={nodes}), found "
                        f"{dist['node_rank']}; no rank would ever join from it")
    if dist["rdzv_backend"] == "static" and nodes > 1 and dist["node_rank"] is None:
        problems.append("distributed.node_rank: expected this machine's index (0.."
                        f"{nodes - 1}) with rdzv_backend: static, found none")
    if dist["backend"] == "nccl" and dist["device"] == "cpu":
        problems.append("distributed.backend: expected 'gloo' or 'auto' with device: cpu, "
                        "found 'nccl' (nccl needs CUDA tensors)")
    config = None
    if not any(p.startswith("pipeline.") for p in problems):  # defaults in for bad keys mislead
        config = _check_pipeline(values["pipeline"], problems)
    _check_optimizer(values["train"]["optimizer"], problems)
    return config


_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64"}


def _dtype_problems(model: dict) -> list[str]:
    """``model.dtype`` casts the built model; a dtype the factory is told to build in
    (``model.args.dtype``, a Hugging Face config's ``torch_dtype`` / ``dtype``) that says another
    is a contradiction: one of the two is silently undone."""
    wanted = model.get("dtype")
    args = model.get("args") or {}
    config = args.get("config") if isinstance(args.get("config"), dict) else {}
    if not wanted:
        return []
    found = []
    for key, value in (("model.args.dtype", args.get("dtype")),
                       ("model.args.config.torch_dtype", config.get("torch_dtype")),
                       ("model.args.config.dtype", config.get("dtype"))):
        if isinstance(value, str) and value not in ("auto",):
            name = value.removeprefix("torch.")
            if _DTYPE_ALIASES.get(name, name) != wanted:
                found.append(f"model.dtype: {wanted}, but {key} says {value}; the model would be "
                             f"built in one and cast to the other: give the dtype once")
    return found


def auto_expert_parallel_refusal(ep: int) -> str:
    """Why ``pp_schedule: auto`` does not plan an expert-parallel run (the one message)."""
    return (f"pipeline.pp_schedule: auto profiles each stage with all of its experts on one "
            f"rank, so it cannot plan distributed.ep_size: {ep} (each rank holding 1/{ep} of "
            f"the experts and routing tokens by all-to-all); name a schedule (e.g. 1f1b), or "
            f"plan at ep_size: 1 with 'pp-core plan' and run what it chose at ep_size: {ep}")


def _restart_problems(dist: dict, ckpt: dict, pipeline: dict) -> list[str]:
    """``max_restarts`` and an elastic ``nnodes: "MIN:MAX"`` need a checkpoint to go on from;
    an elastic run goes on only through a restart (``max_restarts`` > 0), and every node count
    from ``MIN`` to ``MAX`` must hold whole pipeline replicas and share the global batch in
    whole microbatches (:func:`pp_core.app.elastic.refit`: the rule the ranks follow)."""
    found = []
    if dist["max_restarts"] > 0 and not ckpt["dir"]:
        found.append(f"distributed.max_restarts: {dist['max_restarts']} restarts resume from the "
                     f"latest checkpoint, found checkpoint.dir unset (nothing to restart from); "
                     f"add checkpoint.dir: <path> and checkpoint.every: N")
    if not isinstance(dist["nnodes"], str):
        return found
    text = dist["nnodes"]
    low, high = node_range(text)
    dims = ParallelDims.of(dist)
    auto = dist["layout"] == "auto" and dist["world_size"] is not None  # each world planned
    replica = 1 if auto else replica_ranks(dims)
    per_node = dist["nproc_per_node"] or max(1, (dist["world_size"] if auto else
                                                 dims.world_size) // high)
    if auto and per_node * high != dist["world_size"]:
        found.append(f"distributed.world_size: {dist['world_size']} processes are not {high} "
                     f"node(s) (MAX of nnodes {text!r}) x {per_node} process(es); use a "
                     f"world_size that is MAX x nproc_per_node")
    elif low * per_node < replica:
        found.append(f"distributed.nnodes: {text!r} may leave {low} node(s) x {per_node} "
                     f"process(es) = {low * per_node} ranks, fewer than one pipeline replica "
                     f"needs ({replica_formula(dims)} = {replica}); raise MIN to "
                     f"{-(-replica // per_node)}")
    elif not ckpt["dir"]:
        found.append(f"distributed.nnodes: {text!r} lets the run go on with fewer nodes from "
                     f"the latest checkpoint, found checkpoint.dir unset (nothing to go on "
                     f"from); add checkpoint.dir: <path>")
    elif dist["max_restarts"] == 0:
        found.append(f"distributed.nnodes: {text!r} goes on without a lost node by restarting "
                     f"the others, found distributed.max_restarts: 0; set "
                     f"distributed.max_restarts: N (the failures the run survives)")
    elif not auto:  # layout: auto plans each world at launch, and says so where none runs
        batch, size = pipeline.get("pp_batch_size", 1), pipeline.get("pp_microbatch_size", 1)
        if not all(isinstance(v, int) and v > 0 for v in (batch, size)):
            return found  # the pipeline section's own checks say so
        for nodes in range(low, high):
            try:
                refit(dims, batch, size, nodes * per_node)
            except ValueError as why:
                found.append(f"distributed.nnodes: {text!r} may leave {nodes} node(s) x "
                             f"{per_node} process(es) = {nodes * per_node} ranks, {why}; "
                             f"choose a MIN:MAX whose every node count does, or other degrees")
                break
    return found


def _layout_problems(dist: dict, dims) -> list[str]:
    """``distributed.world_size`` / ``layout``: auto needs the world, fixed must agree with it."""
    world = dist["world_size"]
    if dist["layout"] == "auto" and world is None:
        return ["distributed.layout: auto searches the layouts of distributed.world_size "
                "processes, found no world_size; add distributed.world_size: N"]
    if dist["layout"] == "fixed" and world is not None and world != dims.world_size:
        return [f"distributed.world_size: expected {dims.formula()} = {dims.figures()} = "
                f"{dims.world_size}, found {world}; drop world_size, correct it, or set "
                f"distributed.layout: auto to let 'pp-core plan' choose the degrees"]
    return []


def _fold_dp_size(dist: dict, problems: list[str]) -> None:
    """``dp_size`` is the whole data-parallel degree ``dp_replicate * dp_shard``.

    Written alone (files from before ``dp_replicate``/``dp_shard``) it means replicas of the
    pipeline, as it always did. Everything that counts ranks or samples (world size, global
    batch, launch) reads ``dp_size``.
    """
    product = dist["dp_replicate"] * dist["dp_shard"]
    if dist["dp_size"] != 1 and product == 1:
        dist["dp_replicate"] = product = dist["dp_size"]
    elif dist["dp_size"] not in (1, product):
        problems.append(f"distributed.dp_size: expected dp_replicate * dp_shard = "
                        f"{dist['dp_replicate']} * {dist['dp_shard']} = {product}, found "
                        f"{dist['dp_size']}; drop dp_size (it is the older name of dp_replicate)")
    dist["dp_size"] = product
    if dist["mixed_precision"] and product == 1:
        problems.append("distributed.mixed_precision: applies to the data-parallel engines, "
                        "found dp_replicate = dp_shard = 1; set dp_shard or dp_replicate > 1, or "
                        "drop mixed_precision")


def _check_pipeline(pipeline: dict, problems: list[str]) -> PipelineConfig | None:
    """The one :class:`PipelineConfig` a spec builds, or ``None`` with its problem added."""
    try:
        config = PipelineConfig(**pipeline)
    except ConfigError as exc:
        key = f"pipeline.{exc.field}" if exc.field in pipeline else "pipeline"
        problems.append(f"{key}: {exc}")
        return None
    if config.num_microbatches > MAX_MICROBATCHES:
        problems.append(f"pipeline.pp_batch_size: pp_batch_size / pp_microbatch_size = "
                        f"{config.pp_batch_size:,} / {config.pp_microbatch_size:,} = "
                        f"{config.num_microbatches:,} microbatches per step, more than "
                        f"{MAX_MICROBATCHES:,}; use a larger pp_microbatch_size")
    return config


def _check_optimizer(optimizer: dict, problems: list[str]) -> None:
    """``train.optimizer.name`` is a torch.optim class and every other key one of its arguments."""
    import torch  # lazy: torch, only when an optimizer is named

    name = optimizer.get("name", "AdamW")
    classes = {n: c for n, c in vars(torch.optim).items()
               if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
               and c is not torch.optim.Optimizer}
    cls = classes.get(name) if isinstance(name, str) else None
    if cls is None:
        lower = {n.lower(): n for n in classes}
        guess = lower.get(str(name).lower()) or closest(name, classes, cutoff=0.5)
        hint = f"did you mean {guess!r}? " if guess else ""
        problems.append(f"train.optimizer.name: expected a torch.optim class, found "
                        f"{describe_value(name)}; {hint}e.g. AdamW, Adam, SGD")
        return
    optimizer["name"] = name
    params = inspect.signature(cls.__init__).parameters
    accepted = {n: p for n, p in params.items() if n not in ("self", "params")
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for key, value in list(optimizer.items()):
        if key == "name":
            continue
        if key not in accepted:
            hint = did_you_mean(key, accepted, cutoff=0.5, after=" ",
                                show=lambda arg: f"'train.optimizer.{arg}'")
            problems.append(f"train.optimizer.{key}: unknown argument of torch.optim.{name}; "
                            f"{hint}its arguments: {', '.join(accepted)}")
            continue
        default = accepted[key].default
        if isinstance(default, float) and isinstance(value, (str, int)) and \
                not isinstance(value, bool):
            try:
                optimizer[key] = float(value)
            except ValueError:
                problems.append(f"train.optimizer.{key}: expected a number, found "
                                f"{describe_value(value)}")
