"""The schema of a pipeline file, read from where each key is declared: every section, key,
default, checker and one line of docs.

A key is declared once, as a field of its section's dataclass in :mod:`pp_core.app.spec.sections`
(:func:`~pp_core.app.spec.sections.key`: default, checker, doc); the ``pipeline`` keys are the
fields of :class:`~pp_core.config.PipelineConfig`, each key's checker following from the field's
type. :data:`SCHEMA` lists them section by section in field order; ``docs/yaml.md`` has one table
row per key here (a test checks it).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

from pp_core.app.spec.checkers import (anything, flag, integer, integer_or, one_of, optional,
                                       text)
from pp_core.app.spec.sections import KEY, SECTIONS, file_name
from pp_core.config import PipelineConfig, field_specs

__all__ = ["Key", "SCHEMA", "REQUIRED_SECTIONS"]


@dataclass(frozen=True)
class Key:
    """One key of the schema: its checker, its default, and one line of documentation."""

    name: str
    check: Callable[[Any], Any]
    default: Any = None
    doc: str = ""
    required: bool = False
    open_mapping: bool = False  # its value is a free mapping (model.args, optimizer kwargs)


def _section_keys(section: type) -> list[Key]:
    """The keys of a section dataclass: each field as :func:`~pp_core.app.spec.sections.key`
    declared it (a mutable default made afresh by its factory)."""
    keys = []
    for declared in fields(section):
        if KEY not in declared.metadata:
            raise TypeError(f"{section.__name__}.{declared.name} is not declared with "
                            f"pp_core.app.spec.sections.key(default, check, doc)")
        default = declared.default_factory() if declared.default is MISSING else declared.default
        keys.append(Key(file_name(declared), default=default, **declared.metadata[KEY]))
    return keys


def _pipeline_keys() -> list[Key]:
    """``pipeline`` holds the :class:`~pp_core.config.PipelineConfig` fields, verbatim; each
    key's checker follows from the field's declared type (:func:`~pp_core.config.field_specs`)."""
    keys = []
    for declared in field_specs():
        if declared.kind is bool:
            check = flag
        elif declared.kind is int:
            check = integer(declared.minimum)
        elif declared.kind is str:
            check = text  # pp_schedule and pp_schedule_csv both None: PipelineConfig names it
        elif declared.kind == "int_or_auto":
            check = integer_or(declared.minimum, "auto")
        elif declared.kind == "choice":
            check = one_of(*declared.choices)
        else:
            check = anything  # PipelineConfig itself checks these
        if declared.optional and check is not anything:
            check = optional(check)
        keys.append(Key(declared.name, check, declared.default, f"PipelineConfig.{declared.name}"))
    return keys


SCHEMA: dict[str, list[Key]] = {
    name: _pipeline_keys() if section is PipelineConfig else _section_keys(section)
    for name, section in SECTIONS.items()}
REQUIRED_SECTIONS = ("model", "data")
