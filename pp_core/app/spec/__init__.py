"""The YAML pipeline spec: one schema, checked before any process starts.

A pipeline file has the sections ``model``, ``data``, ``pipeline``, ``distributed``, ``train``,
``checkpoint`` and ``output`` (see ``docs/yaml.md``). :func:`load_spec` reads it, applies
``--set key.path=value`` overrides, fills the defaults and checks every key, collecting *all* the
mistakes into one :class:`SpecError` whose lines read::

    pipe.yaml: train.stpes: unknown key; did you mean 'train.steps'?
    pipe.yaml: train.steps: expected a positive int, found 'ten' (str)

A checked :class:`Spec` is frozen: one dataclass per section (:mod:`pp_core.app.spec.sections`),
read as attributes (``spec.train.steps``); ``spec.pipeline`` is the run's
:class:`~pp_core.config.PipelineConfig`, built once here.

Checks that need the installed plugins (model and dataset names, the schedule, the split) live in
:mod:`pp_core.app.check`. YAML is parsed by :mod:`pp_core.app.spec.yaml` (a ``yaml.SafeLoader`` that
also refuses duplicate keys, alias bombs, deep nesting and non-UTF-8 bytes): plain data only, but a
``"module:attr"`` value (``model.target``, ``pipeline.loss_fn``) *imports code* when the
pipeline is built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterable

from pp_core.app.spec.combinations import auto_expert_parallel_refusal, check_combinations
from pp_core.app.spec.checkers import Mismatch, describe_value
from pp_core.app.spec.paths import named_factories, resolve_paths, search_beside
from pp_core.app.spec.schema import REQUIRED_SECTIONS, SCHEMA, Key
from pp_core.app.spec.sections import (SECTIONS, CheckpointSpec, DataSpec, DistributedSpec,
                                       ModelSpec, OutputSpec, TrainSpec, field_values, file_name)
from pp_core.app.spec.yaml import YamlProblem, load_yaml_text, read_yaml
from pp_core.config import PipelineConfig
from pp_core.errors import ConfigError, did_you_mean, quoted
from pp_core.parallel.dims import ParallelDims

__all__ = ["Key", "SCHEMA", "REQUIRED_SECTIONS", "Spec", "SpecError", "load_spec",
           "parse_spec", "apply_overrides", "parse_override", "describe_value",
           "auto_expert_parallel_refusal"]


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
    a new one (:meth:`with_`); ``prediction`` is what ``pipeline.pp_schedule: auto`` chose and
    predicted for the run (the planner's figures, for the run summary), else ``None``."""

    model: ModelSpec
    data: DataSpec
    pipeline: PipelineConfig
    distributed: DistributedSpec
    train: TrainSpec
    checkpoint: CheckpointSpec
    output: OutputSpec
    source: str = "pipeline"
    prediction: dict[str, Any] | None = None

    def with_(self, section: str, **changes: Any) -> "Spec":
        """This spec with ``changes`` to one section (a :class:`PipelineConfig` checks its own)."""
        return replace(self, **{section: replace(getattr(self, section), **changes)})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, plain data as in the file (and ``prediction`` when
        planned)."""
        out = {name: {file_name(f): copy.deepcopy(getattr(getattr(self, name), f.name))
                      for f in fields(cls)} for name, cls in SECTIONS.items()}
        if self.prediction is not None:
            out["prediction"] = copy.deepcopy(self.prediction)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "pipeline") -> "Spec":
        """The spec :meth:`to_dict` gave (on a rank): the values as they are, checked no further
        than :class:`PipelineConfig` checks itself."""
        values = copy.deepcopy(values)
        sections = {name: kind(**field_values(kind, values.get(name, {})))
                    for name, kind in SECTIONS.items()}
        return cls(**sections, source=source, prediction=values.get("prediction"))

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
    pipeline = check_combinations(values, problems,
                                  checkpoints_off=_explicit_null(data, "checkpoint", "dir"))
    if problems:
        raise SpecError(problems, source)
    sections = {name: kind(**field_values(kind, values[name])) for name, kind in SECTIONS.items()
                if name != "pipeline"}
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


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> Spec:
    """Read ``path``, apply ``--set`` overrides, check everything that needs no plugin, and make
    every relative path absolute against the file's folder (:mod:`pp_core.app.spec.paths`; the
    named factories say which of their arguments are paths)."""
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
    spec = parse_spec(apply_overrides(data or {}, overrides), str(file))
    folder = str(file.resolve().parent)
    search_beside(spec, folder)
    return resolve_paths(spec, folder, *named_factories(spec))
