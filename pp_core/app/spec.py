"""The YAML pipeline spec: one schema, checked before any process starts.

A pipeline file has the sections ``model``, ``data``, ``pipeline``, ``distributed``, ``train``,
``checkpoint`` and ``output`` (see ``docs/yaml.md``). :func:`load_spec` reads it, applies
``--set key.path=value`` overrides, fills the defaults and checks every key, collecting *all* the
mistakes into one :class:`SpecError` whose lines read::

    pipe.yaml: train.stpes: unknown key; did you mean 'train.steps'?
    pipe.yaml: train.steps: expected a positive int, found 'ten' (str)

A checked :class:`Spec` is frozen: one dataclass per section (:mod:`pp_core.app.spec_sections`),
read as attributes (``spec.train.steps``); ``spec.pipeline`` is the run's
:class:`~pp_core.config.PipelineConfig`, built once here.

Checks that need the installed plugins (model and dataset names, the schedule, the split) live in
:mod:`pp_core.app.preflight`. YAML is parsed by :mod:`pp_core.app.spec_yaml` (a ``yaml.SafeLoader`` that
also refuses duplicate keys, alias bombs, deep nesting and non-UTF-8 bytes): plain data only, but a
``"module:attr"`` value (``model.target``, ``pipeline.loss_fn``) *imports code* when the
pipeline is built.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable

from pp_core.app.spec_schema import REQUIRED_SECTIONS, SCHEMA, Key, Mismatch, describe_value
from pp_core.app.spec_sections import (SECTIONS, CheckpointSpec, DataSpec, DistributedSpec,
                                       ModelSpec, OutputSpec, TrainSpec)
from pp_core.app.spec_yaml import YamlProblem, load_yaml_text, read_yaml
from pp_core.config import PipelineConfig, is_auto
from pp_core.errors import ConfigError, closest, did_you_mean, quoted
from pp_core.parallel.dims import ParallelDims

__all__ = ["Key", "SCHEMA", "REQUIRED_SECTIONS", "Spec", "SpecError", "load_spec",
           "parse_spec", "apply_overrides", "parse_override", "describe_value"]


class SpecError(ConfigError):
    """One or more mistakes in a pipeline file; ``problems`` holds one line per mistake."""

    def __init__(self, problems: list[str], source: str = "pipeline"):
        self.problems = list(problems)
        self.source = source
        if len(self.problems) == 1:
            super().__init__(f"{source}: {self.problems[0]}")
        else:
            lines = "".join(f"\n  - {p}" for p in self.problems)
            super().__init__(f"{len(self.problems)} problems in {source}:{lines}")


@dataclass(frozen=True)
class Spec:
    """A checked pipeline: one frozen section each (``spec.train.steps``), every default filled
    in; ``spec.pipeline`` is the run's :class:`~pp_core.config.PipelineConfig`. A changed spec is
    a new one (:meth:`with_`); ``plan`` is what ``pipeline.pp_schedule: auto`` predicted."""

    model: ModelSpec
    data: DataSpec
    pipeline: PipelineConfig
    distributed: DistributedSpec
    train: TrainSpec
    checkpoint: CheckpointSpec
    output: OutputSpec
    source: str = "pipeline"
    plan: dict[str, Any] | None = None

    def with_(self, section: str, **changes: Any) -> "Spec":
        """This spec with ``changes`` to one section (a :class:`PipelineConfig` checks its own)."""
        return replace(self, **{section: replace(getattr(self, section), **changes)})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, plain data as in the file (and ``plan`` when planned)."""
        out = {name: {f.name: copy.deepcopy(getattr(getattr(self, name), f.name))
                      for f in fields(cls)} for name, cls in SECTIONS.items()}
        if self.plan is not None:
            out["plan"] = copy.deepcopy(self.plan)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "pipeline") -> "Spec":
        """The spec :meth:`to_dict` gave (on a rank): the values as they are, checked no further
        than :class:`PipelineConfig` checks itself."""
        values = copy.deepcopy(values)
        sections = {name: kind(**values.get(name, {})) for name, kind in SECTIONS.items()}
        return cls(**sections, source=source, plan=values.get("plan"))

    @property
    def dims(self) -> ParallelDims:
        """The run's parallel layout (:class:`~pp_core.parallel.dims.ParallelDims`)."""
        return self.distributed.dims

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def global_batch_size(self) -> int:
        return self.pipeline.pp_batch_size * self.dims.dp


# ----------------------------------------------------------------------------- --set


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=10"`` -> ``(["train", "steps"], 10)``; the value is parsed as YAML."""
    path, sep, raw = text.partition("=")
    keys = path.strip().split(".")
    if not sep or not all(keys):
        raise SpecError([f"--set {quoted(text)}: expected key.path=value, e.g. --set "
                         f"train.steps=10"])

    try:
        value = load_yaml_text(raw) if raw.strip() else None
    except YamlProblem as exc:
        raise SpecError([f"--set {quoted(text)}: the value is not valid YAML ({exc})"]) from None
    return keys, value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """A copy of ``data`` with each ``key.path=value`` set (missing mappings are created)."""
    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise SpecError([f"--set {quoted(text)}: {where} is {describe_value(child)}, not a "
                                 f"mapping, so it has no key {keys[depth + 1]!r}"])
            node = child
        node[keys[-1]] = value
    return data


# ----------------------------------------------------------------------------- checking


def parse_spec(data: Any, source: str = "pipeline") -> Spec:
    """Check a parsed YAML document and fill defaults; raises :class:`SpecError` listing all."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"expected a mapping with sections {', '.join(SCHEMA)}, found "
                         f"{describe_value(data)}"], source)
    for section in data:
        if section not in SCHEMA:
            hint = did_you_mean(section, SCHEMA, cutoff=0.5, after=" ")
            problems.append(f"{section}: unknown section; {hint}sections: {', '.join(SCHEMA)}")
    values: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        raw = data.get(section)
        if raw is None:
            if section in REQUIRED_SECTIONS:
                problems.append(f"{section}: missing section; add '{section}:' with "
                                f"{', '.join(k.name for k in keys if k.required) or 'its keys'}")
            raw = {}
        if not isinstance(raw, dict):
            problems.append(f"{section}: expected a mapping of keys, found {describe_value(raw)}")
            raw = {}
        values[section] = _check_section(section, keys, raw, problems)
    pipeline = _check_combinations(values, problems,
                                   checkpoints_off=_explicit_null(data, "checkpoint", "dir"))
    if problems:
        raise SpecError(problems, source)
    sections = {name: kind(**values[name]) for name, kind in SECTIONS.items() if name != "pipeline"}
    return Spec(**sections, pipeline=pipeline, source=source)


def _check_section(section: str, keys: list[Key], raw: dict, problems: list[str]) -> dict:
    by_name = {k.name: k for k in keys}
    for name in raw:
        if name not in by_name:
            hint = did_you_mean(name, by_name, cutoff=0.5, after=" ",
                                show=lambda key: f"'{section}.{key}'")
            problems.append(f"{section}.{name}: unknown key; {hint}valid keys in {section}: "
                            f"{', '.join(by_name)}")
    out = {}
    for key in keys:
        if key.name not in raw:
            if key.required:
                problems.append(f"{section}.{key.name}: missing; expected {key.doc}")
            out[key.name] = copy.deepcopy(key.default)
            continue
        try:
            out[key.name] = key.check(raw[key.name])
        except Mismatch as bad:
            problems.append(f"{section}.{key.name}: expected {bad.expected}, found "
                            f"{describe_value(raw[key.name])}")
            out[key.name] = copy.deepcopy(key.default)
    return out


def _explicit_null(data: dict, section: str, key: str) -> bool:
    """Whether ``section.key: null`` was written out (in the file or a ``--set``), not left out."""
    raw = data.get(section)
    return isinstance(raw, dict) and key in raw and raw[key] is None


def _check_combinations(values: dict, problems: list[str],
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
    _fold_dp_size(dist, problems)
    dims = ParallelDims.of(dist)
    problems.extend(dims.problems(dist["nnodes"], dist["nproc_per_node"]))
    problems.extend(_layout_problems(dist, dims))
    if dims.ep > 1 and is_auto(values["pipeline"].get("pp_schedule")):
        problems.append(auto_expert_parallel_refusal(dims.ep))
    if dist["nnodes"] > 1 and dist["master_port"] is None and dist["rdzv_endpoint"] is None:
        problems.append("distributed.master_port: expected a port every node can reach when "
                        "nnodes > 1 (or set distributed.rdzv_endpoint: host:port), found none")
    if dist["node_rank"] is not None and dist["node_rank"] >= dist["nnodes"]:
        problems.append(f"distributed.node_rank: expected this machine's index 0.."
                        f"{dist['nnodes'] - 1} (nnodes={dist['nnodes']}), found "
                        f"{dist['node_rank']}; no rank would ever join from it")
    if dist["rdzv_backend"] == "static" and dist["nnodes"] > 1 and dist["node_rank"] is None:
        problems.append("distributed.node_rank: expected this machine's index (0.."
                        f"{dist['nnodes'] - 1}) with rdzv_backend: static, found none")
    if dist["backend"] == "nccl" and dist["device"] == "cpu":
        problems.append("distributed.backend: expected 'gloo' or 'auto' with device: cpu, "
                        "found 'nccl' (nccl needs CUDA tensors)")
    config = None
    if not any(p.startswith("pipeline.") for p in problems):  # defaults in for bad keys mislead
        config = _check_pipeline(values["pipeline"], problems)
    _check_optimizer(values["train"]["optimizer"], problems)
    return config


def auto_expert_parallel_refusal(ep: int) -> str:
    """Why ``pp_schedule: auto`` does not plan an expert-parallel run (the one message)."""
    return (f"pipeline.pp_schedule: auto profiles each stage with all of its experts on one "
            f"rank, so it cannot plan distributed.ep_size: {ep} (each rank holding 1/{ep} of "
            f"the experts and routing tokens by all-to-all); name a schedule (e.g. 1f1b), or "
            f"plan at ep_size: 1 with 'pp-core plan' and run what it chose at ep_size: {ep}")


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


from pp_core.schedule.limits import MAX_MICROBATCHES  # noqa: E402 - the schedule half's limit


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


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> Spec:
    """Read ``path``, apply ``--set`` overrides, and check everything that needs no plugin."""
    file = Path(path)
    if not file.is_file():
        raise SpecError([f"no such file {quoted(str(file))}"], str(file))
    try:
        data = read_yaml(file.read_bytes())
    except YamlProblem as exc:
        raise SpecError([str(exc)], str(file)) from None
    if data is not None and not isinstance(data, dict):
        raise SpecError([f"expected a mapping with sections {', '.join(SCHEMA)}, found "
                         f"{describe_value(data)}"], str(file))
    return parse_spec(apply_overrides(data or {}, overrides), str(file))
