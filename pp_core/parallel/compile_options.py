"""The ``torch.compile`` options pp-core passes on, checked before anything is compiled.

torch checks them only when the first compiled block runs (an unknown backend or mode, a mode
together with ``options``, a string for ``fullgraph``), which is after the ranks started.
:func:`compile_problem` says what is wrong, naming the option; ``validate`` (the YAML's
``train.compile``) and :func:`~pp_core.parallel.compile.apply_compile` both use it.
"""

from __future__ import annotations

from typing import Any

from pp_core.errors import did_you_mean

__all__ = ["COMPILE_MODES", "compile_problem"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch.compile``'s documented modes."""

OPTIONS = ("mode", "fullgraph", "dynamic", "backend", "options")


def compile_problem(options: dict[str, Any]) -> str | None:
    """Why ``torch.compile(**options)`` would fail (``None``: it would not)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        return f"unknown option {unknown[0]!r}; torch.compile takes {', '.join(OPTIONS)}"
    mode, backend = options.get("mode"), options.get("backend")
    if mode is not None and (not isinstance(mode, str) or mode not in COMPILE_MODES):
        return f"mode: expected one of {', '.join(COMPILE_MODES)}, found {mode!r}"
    if mode is not None and options.get("options") is not None:
        return "mode and options: torch.compile takes one or the other, not both; drop one"
    if not isinstance(options.get("fullgraph", False), bool):
        return f"fullgraph: expected true or false, found {options['fullgraph']!r}"
    if options.get("dynamic") is not None and not isinstance(options["dynamic"], bool):
        return f"dynamic: expected true, false or null, found {options['dynamic']!r}"
    extra = options.get("options")
    if extra is not None and (not isinstance(extra, dict) or
                              not all(isinstance(k, str) for k in extra)):
        return f"options: expected a mapping of inductor option names, found {extra!r}"[:200]
    if extra:  # torch ignores nothing here: an unknown name fails the first compiled block
        from pp_core._torch_compat import inductor_options  # lazy: torch, only with options

        known = inductor_options()
        unknown = sorted(name for name in extra if known and name not in known)
        if unknown:
            hint = did_you_mean(unknown[0], sorted(known), cutoff=0.6, show=repr, after="")
            return (f"options: unknown inductor option {unknown[0]!r}; "
                    f"{hint or 'torch.compile(options=...) takes inductor config names'}")
    if backend is not None and not callable(backend):
        if not isinstance(backend, str) or not backend:
            return f"backend: expected a backend name, found {backend!r}"
        from pp_core._torch_compat import compile_backends  # lazy: torch, only for a backend

        known = compile_backends()
        if backend not in known:
            return f"backend: unknown backend {backend!r}; torch has {', '.join(known)}"
    return None
