"""One lazy (PEP 562) face for a package: :func:`lazy_face`.

A package whose public names live in modules that import torch (or load plugins) names them in
``__all__`` without importing them, so ``import pp_core.runtime`` or ``pp-core plugins`` stays
light; each name is imported from its home on first use. One helper instead of a hand-written
``__getattr__`` per package, so a moved name fails the same way everywhere, and
``tests/structure/test_faces.py`` checks that every name of every ``__all__`` resolves.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping

__all__ = ["lazy_face"]


def lazy_face(package: str, homes: Mapping[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package`` (pass ``__name__``): ``homes`` maps each lazy
    name to the module holding it, absolute or relative to the package (``".pipeline"``).

        __getattr__, __dir__ = lazy_face(__name__, {"Pipeline": ".pipeline"})
    """
    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home, package), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
