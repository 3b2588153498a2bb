"""What a value of a pipeline file must be: one checker per kind of value.

Each checker takes the YAML value and returns it (normalised: ``1e-3`` read as a string becomes a
float) or raises :class:`Mismatch` saying what would have been accepted; :mod:`pp_core.app.spec`
turns that into ``key.path: expected ..., found ...``. Each key's declaration
(:func:`pp_core.app.spec.sections.key`) names one.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from pp_core.app.spec.endpoint import address_problem, port_problem, split_endpoint
from pp_core.config import resolve_dtype
from pp_core.errors import ConfigError, did_you_mean, quoted


class Mismatch(Exception):
    """Raised by a checker: ``expected`` says what would have been accepted."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def describe_value(value: Any) -> str:
    """``'ten' (str)``: the value as found (cut short), with its YAML-visible type."""
    return f"{quoted(value, 60)} ({type(value).__name__})"


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable:
    word = {0: "an int >= 0", 1: "a positive int"}.get(minimum, "an int")
    if maximum is not None:
        word = f"an int in [{minimum}, {maximum}]"

    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or \
                (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise Mismatch(word)
        return value
    return check


def number(minimum: float | None = None, maximum: float | None = None) -> Callable:
    bounds = f" in [{minimum}, {maximum}]" if maximum is not None else \
        (f" >= {minimum}" if minimum is not None else "")

    def check(value):
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                raise Mismatch(f"a finite number{bounds}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or (minimum is not None and value < minimum) or \
                (maximum is not None and value > maximum):
            raise Mismatch(f"a finite number{bounds}")
        return float(value)
    return check


def positive_number(value):
    """A finite number > 0 (``grad_clip: 0`` would zero every update)."""
    found = number(0.0)(value)
    if found <= 0:
        raise Mismatch("a finite number > 0")
    return found


def integer_or(minimum: int, word: str) -> Callable:
    """An int >= ``minimum``, or the string ``word`` (``pp_seq_chunks: auto``)."""
    as_int = integer(minimum)

    def check(value):
        if isinstance(value, str) and value.lower() == word:
            return word
        try:
            return as_int(value)
        except Mismatch:
            raise Mismatch(f"a positive int or {word!r}") from None
    return check


def text(value):
    if not isinstance(value, str) or not value:
        raise Mismatch("a non-empty string")
    return value


def flag(value):
    if not isinstance(value, bool):
        raise Mismatch("true or false")
    return value


def mapping(value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Mismatch("a mapping (key: value lines)")
    return dict(value)


def one_of(*options: str) -> Callable:
    def check(value):
        if isinstance(value, bool) and "off" in options:  # YAML 1.1 reads `off` as false
            return "off" if not value else options[0]
        if not isinstance(value, str) or value.lower() not in options:
            hint = did_you_mean(str(value).lower(), options, before=" (", after=")")
            raise Mismatch(f"one of {', '.join(map(repr, options))}{hint}")
        return value.lower()
    return check


def optional(inner: Callable) -> Callable:
    def check(value):
        return None if value is None else inner(value)
    check.__name__ = f"optional_{getattr(inner, '__name__', 'value')}"
    return check


def resume(value):
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str) and value:
        return value
    raise Mismatch("true, false, or the path of a checkpoint directory")


def nnodes(value):
    """A positive int, or torchrun's ``"MIN:MAX"`` (``"N:N"`` is ``N``); a ``MIN < MAX`` is
    returned as the text, for :mod:`pp_core.app.spec.combinations` to judge with the degrees."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    expected = "a positive int, or 'MIN:MAX' with 1 <= MIN <= MAX (torchrun's form)"
    if not isinstance(value, str) or value.count(":") != 1:
        raise Mismatch(expected)
    low, high = (part.strip() for part in value.split(":"))
    if not (low.isdecimal() and high.isdecimal()) or not 1 <= int(low) <= int(high):
        raise Mismatch(expected)
    return int(low) if int(low) == int(high) else f"{int(low)}:{int(high)}"


def node_range(value) -> tuple[int, int]:
    """``(MIN, MAX)`` of a checked ``distributed.nnodes``: ``(N, N)`` for an int, torchrun's
    ``"MIN:MAX"`` read as written."""
    if isinstance(value, str):
        low, high = (int(part) for part in value.split(":"))
        return low, high
    return int(value), int(value)


def export_hf(value):
    if value is None or value is False:
        return None
    if isinstance(value, str) and value:
        return {"dir": value, "every": None}
    if isinstance(value, dict) and isinstance(value.get("dir"), str) and value["dir"] \
            and set(value) <= {"dir", "every"}:
        every = value.get("every")
        if every is None or (isinstance(every, int) and not isinstance(every, bool) and every > 0):
            return {"dir": value["dir"], "every": every}
    raise Mismatch("a directory, or {dir: DIR, every: N} with N a positive int")


def address(value):
    problem = address_problem(text(value))
    if problem is not None:
        raise Mismatch(problem)
    return value


def port(value):
    problem = port_problem(value)
    if problem is not None:
        raise Mismatch(problem)
    return value


def endpoint(value):
    try:
        split_endpoint(text(value))
    except ValueError as exc:
        raise Mismatch(str(exc)) from None
    return value


def anything(value):
    return value


def activation_checkpointing(value):
    """``{mode: none|full|selective|auto, every: N}``; ``mode`` may also be a list with one
    mode per stage (what the planner writes); a bare mode (or list) is accepted too."""
    if isinstance(value, (str, list)) or value is None or isinstance(value, bool):
        value = {"mode": "none" if not value else value}
    expected = ("a mapping {mode: none | full | selective | auto, or a list of none / full / "
                "selective with one entry per stage, every: a positive int}")
    if not isinstance(value, dict) or set(value) - {"mode", "every"}:
        raise Mismatch(expected)
    mode = value.get("mode", "full")
    every = value.get("every", 1)
    modes = mode if isinstance(mode, list) else [mode]
    allowed = ("none", "full", "selective") + (() if isinstance(mode, list) else ("auto",))
    if not modes or any(not isinstance(m, str) or m.lower() not in allowed for m in modes) or \
            isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise Mismatch(expected)
    lowered = [m.lower() for m in modes]
    return {"mode": lowered if isinstance(mode, list) else lowered[0], "every": every}


def compile_options(value):
    """``{enabled: bool, ...torch.compile keyword arguments}``; ``true``/``false`` alone too."""
    if isinstance(value, bool) or value is None:
        return {"enabled": bool(value)}
    allowed = {"enabled", "mode", "fullgraph", "dynamic", "backend", "options"}
    if not isinstance(value, dict) or set(value) - allowed or \
            not isinstance(value.get("enabled", True), bool):
        raise Mismatch(f"true, false, or a mapping with keys {', '.join(sorted(allowed))} "
                       f"(enabled: a bool; the others go to torch.compile)")
    from pp_core.parallel.compile_options import compile_problem  # lazy: torch, only when set

    problem = compile_problem({k: v for k, v in value.items() if k != "enabled"})
    if problem is not None:
        raise Mismatch(f"torch.compile options ({problem})")
    return {"enabled": True, **value}


def mixed_precision(value):
    """``{param_dtype, reduce_dtype}``: floating-point torch dtype names."""
    from pp_core.parallel.data_parallel import mixed_precision_policy  # lazy: torch, only when set

    expected = "a mapping {param_dtype, reduce_dtype} of float32, bfloat16 or float16"
    if not isinstance(value, dict) or not value or set(value) - {"param_dtype", "reduce_dtype"}:
        raise Mismatch(expected)
    try:
        mixed_precision_policy(value)
    except ConfigError:
        raise Mismatch(expected) from None
    return dict(value)


def param_dtype(value):
    """A floating-point torch dtype name (``model.dtype``)."""
    expected = "a floating-point dtype name: float32, bfloat16, float16 or float64"
    try:
        dtype = resolve_dtype(value)
    except ConfigError:
        raise Mismatch(expected) from None
    if not dtype.is_floating_point:
        raise Mismatch(expected)
    if dtype.itemsize < 2:  # as pipeline.dtype: a storage format, no arithmetic on CPU or in Adam
        raise Mismatch(f"{expected} (float8 is a storage format the model cannot compute in)")
    return str(dtype).removeprefix("torch.")


def lora(value):
    """``{r, alpha, dropout, target_modules, ...}``: peft.LoraConfig checks the rest."""
    expected = ("a mapping {r: a positive int, alpha: a number, dropout: 0 <= p < 1, "
                "target_modules: a list of module names, ...}")
    if not isinstance(value, dict) or any(not isinstance(k, str) for k in value):
        raise Mismatch(expected)
    r, dropout = value.get("r", 8), value.get("dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or isinstance(dropout, bool) or \
            not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise Mismatch(expected)
    return dict(value)


def patterns(value):
    """A list of fnmatch patterns (one string alone too)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or \
            not all(isinstance(v, str) and v for v in items):
        raise Mismatch("a list of parameter or module name patterns, e.g. [tok_*, layers.0]")
    return list(items)
